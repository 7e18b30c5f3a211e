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
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class FlashDotProductAttention(DotProductAttention):
        def __init__(self, *args, kernels, sparse_mode: int = 0, pre_tokens: int = NO_LIMIT,
                     next_tokens: int = NO_LIMIT, alibi: dict | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.kernels = kernels              # the run's backend's (a spec param: flash_settings)
            self.sparse_mode, self.pre_tokens, self.next_tokens = sparse_mode, pre_tokens, next_tokens
            self.alibi = AlibiBias(self, alibi) if alibi else None

        def _defer(self, attention_bias, packed_seq_params) -> bool:
            return (self.config.context_parallel_size > 1 or attention_bias is not None
                    or packed_seq_params is not None or getattr(self, "softmax_offset", None) is not None
                    or getattr(self.scale_mask_softmax, "window_size", None) is not None)   # core >= 0.13

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            docs = documents.ends_in(attention_mask)    # EOD reset: the micro-batch's documents
            if self._defer(attention_bias, packed_seq_params):
                if self.alibi is not None:
                    raise NotImplementedError("alibi: Megatron's attention (bias, packed sequences, windows) adds none")
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
            band["alibi"] = self.alibi and self.alibi(sq, skv, query.device)   # [1, n, sq, skv] fp32, or None
            if docs is not None:     # attention inside each document, no [s, s] mask
                documents.check(docs, b, sq)
                if self.sparse_mode == 1:   # 'the given mask only': the documents' mask, causal in each
                    band = dict(causal=True, alibi=band["alibi"])

            def run():
                if docs is not None:
                    return _attend_documents(query, key, value, docs, kernels=self.kernels, scale=scale,
                                             dropout_p=dropout_p, **band)
                return self.kernels.attention(   # v's head size may be its own (multi-latent attention)
                    query.reshape(sq, b, heads * head_dim), key.reshape(skv, b, kv_heads * head_dim),
                    value.reshape(skv, b, kv_heads * value.shape[-1]), layout="SBH", head_num=heads,
                    mask=attention_mask, scale=scale, dropout_p=dropout_p, **band)[0]

            return _with_dropout_rng(self, dropout_p, run)

    return FlashDotProductAttention


def _attend_documents(query, key, value, docs, **kwargs):
    """[s, b, n, d] q/k/v of packed documents (v's d may be its own) -> [s, b, n*dv] (one TND kernel call)."""
    sq, b, heads, head_dim = query.shape
    sbh = lambda t: t.reshape(t.shape[0], b, t.shape[2] * t.shape[3])
    return documents.attention(sbh(query), sbh(key), sbh(value), docs, head_num=heads, **kwargs)[0]


class AlibiCache:
    """The alibi biases of a run, one tensor per key, shared by every attention layer (a [1, n, s, s]
    fp32 bias is about 2 GiB per layer at seq 4096 with 32 heads: one copy, not one per layer). The
    key is all that determines a bias; the newest few are kept (a run sees one or two lengths)."""

    KEEP = 4

    def __init__(self):
        self._biases: dict = {}

    def get(self, key, build):
        bias = self._biases.pop(key, None)
        if bias is None:
            bias = build()
        self._biases[key] = bias                   # newest last
        while len(self._biases) > self.KEEP:
            del self._biases[next(iter(self._biases))]
        return bias

    def __len__(self) -> int:
        return len(self._biases)


class AlibiBias:
    """An attention module's alibi bias (features/fused/alibi.py): the slopes of the heads its TP rank
    holds (their global indices); the fp32 [1, heads, sq, skv] biases come from the run's AlibiCache
    (settings["cache"], one per spec: every layer shares it). A plain attribute, not a buffer:
    checkpoints stay those of a model without alibi."""

    def __init__(self, module, settings: dict):
        from mindspeed.features.fused import alibi
        tp = module.tp_group
        self.slopes = tuple(alibi.local_slopes(module.config.num_attention_heads, tp.size(), tp.rank()))
        self.diagonal_opposite = bool(settings.get("diagonal_opposite"))
        self.fill_neg_inf = bool(settings.get("fill_neg_inf"))
        cache = settings.get("cache")    # (an empty cache is falsy: no `or`)
        self.cache = AlibiCache() if cache is None else cache

    @property
    def mask_fill(self) -> float:
        """What a masked score becomes in the unfused softmax (Megatron's -10000; --fill-neg-inf: -inf)."""
        return float("-inf") if self.fill_neg_inf else -10000.0

    def __call__(self, sq: int, skv: int, device, *, causal_fill: float | None = None):
        """The bias; causal_fill: with `causal_fill` above the diagonal (a causal mask folded in)."""
        import torch
        key = (self.slopes, sq, skv, self.diagonal_opposite, causal_fill, torch.float32, str(device))

        def build():
            bias = alibi_bias(self.slopes, sq, skv, diagonal_opposite=self.diagonal_opposite, device=device)
            if causal_fill is None:
                return bias
            return bias.masked_fill(torch.ones(sq, skv, dtype=torch.bool, device=device).triu(1), causal_fill)
        return self.cache.get(key, build)


def alibi_bias(slopes, sq: int, skv: int, *, diagonal_opposite: bool = False, device=None):
    """[1, len(slopes), sq, skv] fp32: -m_h * |i - j| (diagonal_opposite: -m_h * (i - j)) for query
    position i and key position j."""
    import torch
    i = torch.arange(sq, device=device, dtype=torch.float64)
    j = torch.arange(skv, device=device, dtype=torch.float64)
    distance = i[:, None] - j[None, :]
    if not diagonal_opposite:
        distance = distance.abs()
    m = torch.tensor(slopes, device=device, dtype=torch.float64)
    return (-m[:, None, None] * distance).unsqueeze(0).float()


def _with_dropout_rng(module, dropout_p: float, run):
    """run() under Megatron's model-parallel RNG when attention dropout draws (as Megatron's attention)."""
    if dropout_p > 0 and not module.config.sequence_parallel:
        from megatron.core import tensor_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return run()
    return run()


def _alibi_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from mindspeed.features.memory.shared_mask import is_shared

    class AlibiDotProductAttention(DotProductAttention):
        """Megatron-Core's unfused attention with the alibi bias added to the scaled scores (no
        --use-flash-attn): the backend's reference attention, softmax(scale QK^T + bias) V, with the
        mask folded into the bias at -10000 (Megatron's unfused softmax; -inf with --fill-neg-inf).
        A causal layer's folded bias is cached; other masks are folded per call."""

        def __init__(self, *args, alibi: dict, kernels, **kwargs):
            super().__init__(*args, **kwargs)
            self.kernels = kernels              # the run's backend's (a spec param)
            self.alibi = AlibiBias(self, alibi)

        def _bias(self, attention_mask, causal: bool, sq: int, skv: int, device):
            if (attention_mask is None and causal) or is_shared(attention_mask):
                return self.alibi(sq, skv, device, causal_fill=self.alibi.mask_fill)
            bias = self.alibi(sq, skv, device)
            return bias if attention_mask is None else bias.masked_fill(attention_mask.bool(), self.alibi.mask_fill)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if attention_bias is not None or packed_seq_params is not None:
                raise NotImplementedError("alibi takes no attention bias or packed sequences")
            sq, b, heads, head_dim = query.shape
            skv, _, kv_heads, _ = key.shape
            causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            bias = self._bias(attention_mask, causal, sq, skv, query.device)
            scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
            dropout_p = self.attention_dropout.p if self.training else 0.0
            return _with_dropout_rng(self, dropout_p, lambda: self.kernels.reference.attention(
                query.reshape(sq, b, heads * head_dim), key.reshape(skv, b, kv_heads * head_dim),
                value.reshape(skv, b, kv_heads * value.shape[-1]), layout="SBH", head_num=heads, scale=scale,
                dropout_p=dropout_p, alibi=bias)[0])

    return AlibiDotProductAttention


@functools.cache
def alibi_attention_class():
    """AlibiDotProductAttention, built on first use (as flash_attention_class)."""
    return _alibi_class()


@functools.cache
def flash_attention_class():
    """FlashDotProductAttention, built on first use (it subclasses Megatron-Core's DotProductAttention,
    imported only then); one class per process, so every spec names the same module."""
    return _flash_class()


def core_attention_spec(settings: dict, cls=None):
    """The ModuleSpec of the flash attention (or `cls`) with these settings (its params: flash_settings)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    return ModuleSpec(module=cls or flash_attention_class(), params=dict(settings))


def _class_with_settings(settings: dict, cls=None):
    """core 0.12's spec names a class, not a ModuleSpec: bind the settings (kernels too) into a subclass."""
    cls = cls or flash_attention_class()
    return type(cls.__name__, (cls,), {"__init__": functools.partialmethod(cls.__init__, **settings)})


def alibi_settings(args) -> dict | None:
    """The alibi bias's settings (features/fused/alibi.py), None without --position-embedding-type alibi."""
    if getattr(args, "position_embedding_type", None) != "alibi":
        return None
    return dict(diagonal_opposite=bool(args.alibi_diagonal_opposite), fill_neg_inf=bool(args.fill_neg_inf),
                cache=AlibiCache())   # one per spec: every layer's module shares it


def flash_settings(args, kernels) -> dict:
    """The attention's parameters: the sparse settings of the flags, the alibi bias's, and the kernels it calls."""
    return dict(sparse_mode=args.sparse_mode, pre_tokens=args.pre_tockens, next_tokens=args.next_tockens,
                alibi=alibi_settings(args), kernels=kernels)


def install(ctx, args) -> None:
    settings = flash_settings(args, ctx.backend.kernels)
    ctx.provide(SPEC_CORE_ATTENTION, core_attention_spec(settings))
    if not ctx.specs_from_session:
        _patch_specs(ctx.patcher, settings)


def install_alibi(ctx, args) -> None:
    """--position-embedding-type alibi: with flash attention its module adds the bias (install above);
    without, the unfused AlibiDotProductAttention takes every core attention slot."""
    if ctx.applies("flash-attn"):
        return
    settings = dict(alibi=alibi_settings(args), kernels=ctx.backend.kernels)
    ctx.provide(SPEC_CORE_ATTENTION, core_attention_spec(settings, alibi_attention_class()))
    if not ctx.specs_from_session:
        _patch_specs(ctx.patcher, settings, alibi_attention_class(), "--position-embedding-type alibi")


def _patch_specs(patcher, settings: dict, cls=None, reason: str = "--use-flash-attn") -> None:
    if has_local_spec_provider():
        patcher.replace(f"{LOCAL_SPEC_PROVIDER}.core_attention", lambda self: core_attention_spec(settings, cls),
                        reason=reason)
    else:
        patcher.replace(f"{GPT_LAYER_SPECS}.DotProductAttention", _class_with_settings(settings, cls),
                        reason=reason)
