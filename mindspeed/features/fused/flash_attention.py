"""--use-flash-attn (+ --sparse-mode, --pre-tockens, --next-tockens): Megatron-Core's core
attention calls kernels.attention (npu_fusion_attention; torch's CPU flash kernel on cpu).

Hook: the local spec provider's core_attention becomes a ModuleSpec of FlashDotProductAttention
with the sparse settings as params. It subclasses DotProductAttention, so whatever wraps that
class (context parallelism) still runs: with CP, or for inputs the kernel path does not take
(attention bias, packed sequences, sliding windows, softmax offsets), it defers to it.

sparse modes (as npu_fusion_attention): 0 the layer's mask (causal layers stay causal);
1 the given mask only (with --reset-attention-mask: the documents' mask, causal in each document);
2 causal top-left; 3 causal bottom-right; 4 band
i - pre_tockens <= j <= i + next_tockens (also causal in a causal layer).
"""
from __future__ import annotations

import functools

from mindspeed.features import documents
from mindspeed.features.fused.megatron_specs import (GPT_LAYER_SPECS, LOCAL_SPEC_PROVIDER, SPEC_CORE_ATTENTION,
                                                     has_local_spec_provider)

SPARSE_MODES = (0, 1, 2, 3, 4)   # features.py lists the same modes
NO_LIMIT = 2**31 - 1


def band_arguments(sparse_mode: int, causal_layer: bool, sq: int, skv: int, pre: int, nxt: int) -> dict:
    """Kernel keyword arguments (causal, pre_tokens, next_tokens) for a sparse mode."""
    if sparse_mode == 0:
        return dict(causal=causal_layer)
    if sparse_mode == 1:
        return dict(causal=False)
    if sparse_mode == 2:
        return dict(causal=True)
    if sparse_mode == 3:   # bottom-right aligned causal: row i sees keys j <= i + (skv - sq)
        return dict(causal=False, next_tokens=skv - sq)
    if sparse_mode == 4:
        return dict(causal=causal_layer, pre_tokens=pre, next_tokens=nxt)
    raise ValueError(f"sparse_mode {sparse_mode} is not one of {SPARSE_MODES}")


def _is_plain_causal(mask, sq: int, skv: int) -> bool:
    """True when `mask` (True = masked) is exactly the top-left causal mask for every batch/head."""
    if mask is None or tuple(mask.shape[-2:]) != (sq, skv):
        return False
    from mindspeed.features.memory.shared_mask import is_shared  # imports torch: this module stays framework-free
    if is_shared(mask):      # the shared causal mask: no s x s comparison per layer
        return True
    import torch
    causal = torch.ones(sq, skv, dtype=torch.bool, device=mask.device).triu(1)
    return bool((mask.bool() == causal).all())


def _flash_class():
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class FlashDotProductAttention(DotProductAttention):
        def __init__(self, *args, kernels, sparse_mode: int = 0, pre_tokens: int = NO_LIMIT,
                     next_tokens: int = NO_LIMIT, **kwargs):
            super().__init__(*args, **kwargs)
            self.kernels = kernels              # the run's backend's (a spec param: flash_settings)
            self.sparse_mode, self.pre_tokens, self.next_tokens = sparse_mode, pre_tokens, next_tokens

        def _defer(self, attention_bias, packed_seq_params) -> bool:
            return (self.config.context_parallel_size > 1 or attention_bias is not None
                    or packed_seq_params is not None or getattr(self, "softmax_offset", None) is not None
                    or getattr(self.scale_mask_softmax, "window_size", None) is not None)   # core >= 0.13

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            docs = documents.ends_in(attention_mask)    # EOD reset: the micro-batch's documents
            if self._defer(attention_bias, packed_seq_params):
                if docs is not None and self.config.context_parallel_size == 1:
                    raise NotImplementedError("--reset-attention-mask with flash attention: attention bias, "
                                              "packed sequences and sliding windows cannot take the documents")
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            sq, b, heads, head_dim = query.shape
            skv, _, kv_heads, _ = key.shape
            causal_layer = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            band = band_arguments(self.sparse_mode, causal_layer, sq, skv, self.pre_tokens, self.next_tokens)
            if docs is not None or (band.get("causal") and _is_plain_causal(attention_mask, sq, skv)):
                attention_mask = None   # the kernel's own causal path: no s x s mask in memory
            # Megatron folds 1/layer_number into softmax_scale when it rescales in the softmax
            scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
            dropout_p = self.attention_dropout.p if self.training else 0.0
            if docs is not None:     # attention inside each document, no [s, s] mask
                documents.check(docs, b, sq)
                if self.sparse_mode == 1:   # 'the given mask only': the documents' mask, causal in each
                    band = dict(causal=True)

            def run():
                if docs is not None:
                    return _attend_documents(query, key, value, docs, kernels=self.kernels, scale=scale,
                                             dropout_p=dropout_p, **band)
                return self.kernels.attention(   # v's head size may be its own (multi-latent attention)
                    query.reshape(sq, b, heads * head_dim), key.reshape(skv, b, kv_heads * head_dim),
                    value.reshape(skv, b, kv_heads * value.shape[-1]), layout="SBH", head_num=heads,
                    mask=attention_mask, scale=scale, dropout_p=dropout_p, **band)[0]

            if dropout_p > 0 and not self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():   # as Megatron's attention dropout
                    return run()
            return run()

    return FlashDotProductAttention


def _attend_documents(query, key, value, docs, **kwargs):
    """[s, b, n, d] q/k/v of packed documents (v's d may be its own) -> [s, b, n*dv] (one TND kernel call)."""
    sq, b, heads, head_dim = query.shape
    sbh = lambda t: t.reshape(t.shape[0], b, t.shape[2] * t.shape[3])
    return documents.attention(sbh(query), sbh(key), sbh(value), docs, head_num=heads, **kwargs)[0]


@functools.cache
def flash_attention_class():
    """FlashDotProductAttention, built on first use (it subclasses Megatron-Core's DotProductAttention,
    imported only then); one class per process, so every spec names the same module."""
    return _flash_class()


def core_attention_spec(settings: dict):
    """The ModuleSpec of the flash attention with these settings (its params: flash_settings)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    return ModuleSpec(module=flash_attention_class(), params=dict(settings))


def _class_with_settings(settings: dict):
    """core 0.12's spec names a class, not a ModuleSpec: bind the settings (kernels too) into a subclass."""
    cls = flash_attention_class()
    return type(cls.__name__, (cls,), {"__init__": functools.partialmethod(cls.__init__, **settings)})


def flash_settings(args, kernels) -> dict:
    """The attention's parameters: the sparse settings of the flags, and the kernels it calls."""
    return dict(sparse_mode=args.sparse_mode, pre_tokens=args.pre_tockens, next_tokens=args.next_tockens,
                kernels=kernels)


def install(ctx, args) -> None:
    settings = flash_settings(args, ctx.backend.kernels)
    ctx.provide(SPEC_CORE_ATTENTION, core_attention_spec(settings))
    if not ctx.specs_from_session:
        _patch_specs(ctx.patcher, settings)


def _patch_specs(patcher, settings: dict) -> None:
    if has_local_spec_provider():
        patcher.replace(f"{LOCAL_SPEC_PROVIDER}.core_attention", lambda self: core_attention_spec(settings),
                        reason="--use-flash-attn")
    else:
        patcher.replace(f"{GPT_LAYER_SPECS}.DotProductAttention", _class_with_settings(settings),
                        reason="--use-flash-attn")
