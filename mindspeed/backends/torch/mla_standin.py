"""Megatron-Core's multi-latent attention (MLASelfAttention) on its local modules, without Transformer
Engine: what --multi-latent-attention builds in the trainers (and Megatron-LM's --transformer-impl local).

MLA builds its core attention with `k_channels` (the q/k head size, qk_head_dim + qk_pos_emb_head_dim),
`v_channels` (v_head_dim) and its own softmax_scale (YaRN's mscale included). TE's attention takes
them; Megatron's local DotProductAttention, and FlashDotProductAttention (--use-flash-attn, its
subclass), do not: they size heads by kv_channels. The stand-in is the spec's class with MLA's head
sizes (MLAHeadSizes below), bound to MLA's core attention only: MultiLatentAttention.__init__ builds
its core attention from it, every other attention keeps the class it had. Megatron's own forward
needs nothing else (its value matmul and output already follow v), nor does the flash path (the
attention kernel takes v's head size as it is, docs/kernels.md).

Without TE, MLA's module finds Megatron's mocks of TE's linears and takes TE for present (its
HAVE_TE): that flag is set False.

Megatron-Core's local spec gives MLA's down projections as ColumnParallelLinear, whose sharded
output MLA gathers itself: no replicated linear (TE's `linear()`) is needed. One gradient is
mis-reduced on that spec: finalize_model_grads sums the grads of every parameter named
`q_layernorm` over tensor-parallel ranks when --qk-layernorm is on (per-head q norms see only the
rank's heads), but MLA's q_layernorm normalises the whole compressed query, the same on every rank
without sequence parallelism, so the sum is TP times the gradient (TE's spec fuses that norm into
linear_q_up_proj, under another name). Those grads are divided by the TP size before that sum.
And one is lost: the key's RoPE part k_pos_emb, shared by all heads, is gathered from the sharded
down projection on every rank, but each rank's heads give only their share of its gradient and the
gather's backward keeps only this rank's slice (_KeyPositionGrads adds the other ranks' share).
"""
from __future__ import annotations

import dataclasses
import inspect

MLA_MODULE = "megatron.core.transformer.multi_latent_attention"
#: what apply_mla_standin patches (HAVE_TE where Transformer Engine is absent)
PATCH_TARGETS = (f"{MLA_MODULE}.MultiLatentAttention.__init__", f"{MLA_MODULE}.MLASelfAttention.__init__",
                 f"{MLA_MODULE}.MLASelfAttention.get_query_key_value_tensors",
                 "megatron.core.distributed.finalize_model_grads._allreduce_non_tensor_model_parallel_grads",
                 f"{MLA_MODULE}.HAVE_TE")
REPLICATED_Q_NORM = "_mindspeed_mla_q_norm"     # marks MLA's q_layernorm parameters

_variants: dict = {}


class MLAHeadSizes:
    """Over DotProductAttention (or a subclass): q/k heads of `k_channels`, v heads and the output
    of `v_channels` per head, one key/value head per query head (MLA has no query groups), the
    softmax scale MLA gives (1/sqrt(k_channels) when it gives none, as TE's attention)."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        if k_channels is not None and kwargs.get("softmax_scale") is None and len(args) < 6:
            kwargs["softmax_scale"] = k_channels ** -0.5
        super().__init__(*args, **kwargs)
        if self.config.context_parallel_size > 1:
            raise NotImplementedError("multi-latent attention with context parallelism: MindSpeed's CP attention "
                                      "takes one head size for q, k and v; drop --context-parallel-size")
        heads = self.num_attention_heads_per_partition
        self.num_query_groups_per_partition = heads
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * heads


def mla_variant(cls: type) -> type:
    """`cls` with MLA's head sizes (one class per `cls`)."""
    if cls not in _variants:
        _variants[cls] = type(f"MLA{cls.__name__}", (MLAHeadSizes, cls),
                              {"__module__": __name__, "__doc__": f"{cls.__name__} with MLA's head sizes."})
    return _variants[cls]


def _takes_head_sizes(cls: type) -> bool:
    return "k_channels" in inspect.signature(cls.__init__).parameters


def mla_core_attention(spec):
    """The spec's core attention (a class, or a ModuleSpec of one) with MLA's head sizes where it is
    Megatron's local DotProductAttention or a subclass that does not take them itself; else `spec`."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    if not (isinstance(module, type) and issubclass(module, DotProductAttention)) or _takes_head_sizes(module):
        return spec
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, module=mla_variant(module))
    return mla_variant(module)


def _wrap_mla_init(original):
    def __init__(self, *args, **kwargs):
        # MLASelfAttention passes everything by keyword; positionally, submodules follows config
        if "submodules" in kwargs:
            kwargs["submodules"] = _with_mla_core_attention(kwargs["submodules"])
        elif len(args) > 1:
            args = (args[0], _with_mla_core_attention(args[1])) + tuple(args[2:])
        original(self, *args, **kwargs)
    return __init__


def _with_mla_core_attention(submodules):
    core = mla_core_attention(submodules.core_attention)
    return submodules if core is submodules.core_attention else dataclasses.replace(submodules, core_attention=core)


def _wrap_mla_self_attention_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        norm = getattr(self, "q_layernorm", None)
        if norm is not None and not self.config.sequence_parallel:
            for param in norm.parameters():
                setattr(param, REPLICATED_Q_NORM, True)
    return __init__


class _KeyPositionGrads:
    """Identity on MLA's key [.., heads, qk_head_dim + qk_pos_emb_head_dim]; backward: the RoPE part's
    gradient of every TP rank's heads reaches k_pos_emb. Every head's key shares one k_pos_emb, which
    the local spec's ColumnParallelLinear down projection computes once on every rank (gathered), but
    each rank's heads add only their own share of its gradient, and the gather's backward keeps this
    rank's slice of it: the other ranks' heads are lost. Here each rank's first head also carries what
    the other ranks' heads give (one all-reduce of [.., 1, qk_pos_emb_head_dim]), so the sum over
    its heads is the whole gradient on every rank."""

    _function = None

    @classmethod
    def apply(cls, key, pos_dim: int, group):
        if cls._function is None:
            import torch

            class KeyPositionGrads(torch.autograd.Function):
                @staticmethod
                def forward(ctx, key, pos_dim, group):
                    ctx.pos_dim, ctx.group = pos_dim, group
                    return key.view_as(key)

                @staticmethod
                def backward(ctx, grad):
                    local = grad[..., -ctx.pos_dim:].sum(-2, keepdim=True)    # this rank's heads
                    total = local.clone()
                    torch.distributed.all_reduce(total, group=ctx.group)
                    grad = grad.clone()
                    grad[..., :1, -ctx.pos_dim:] += total - local
                    return grad, None, None

            cls._function = KeyPositionGrads
        return cls._function.apply(key, pos_dim, group)


def _wrap_query_key_value(original):
    def get_query_key_value_tensors(self, *args, **kwargs):
        query, key, value, *rest = original(self, *args, **kwargs)
        if key is not None and key.requires_grad and _shares_key_position_by_gather(self):
            key = _KeyPositionGrads.apply(key, self.config.qk_pos_emb_head_dim, self.tp_group)
        return (query, key, value, *rest)
    return get_query_key_value_tensors


def _shares_key_position_by_gather(attention) -> bool:
    """k_pos_emb came from a TP-sharded down projection gathered over the ranks (the local spec)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    return (attention.tp_group is not None and attention.tp_group.size() > 1
            and isinstance(attention.linear_kv_down_proj, ColumnParallelLinear)
            and not attention.config.cache_mla_latents)


def _wrap_non_tp_grads(original):
    def allreduce(model, config, *args, **kwargs):
        tp_group = kwargs.get("tp_group", args[0] if args else None)
        if getattr(config, "qk_layernorm", False) and not config.sequence_parallel:
            _share_replicated_q_norm_grads(model, tp_group)
        return original(model, config, *args, **kwargs)
    return allreduce


def _share_replicated_q_norm_grads(model, tp_group) -> None:
    """MLA's q_layernorm grads, equal on every TP rank, each divided by the TP size: Megatron's sum
    over the ranks that follows gives the gradient once."""
    from megatron.core.distributed.finalize_model_grads import get_tensor_model_parallel_group_if_none
    size = get_tensor_model_parallel_group_if_none(tp_group).size()
    if size <= 1:
        return
    for chunk in model:
        for param in chunk.parameters():
            if getattr(param, REPLICATED_Q_NORM, False) and param.requires_grad:
                grad = getattr(param, "main_grad" if hasattr(param, "main_grad") else "grad")   # as Megatron reads it
                if grad is not None:
                    grad.div_(size)


def apply_mla_standin(patcher) -> None:
    """MLA's core attention with its head sizes, and its q norm's grads reduced once; both act on
    multi-latent attention only. A Megatron-Core without a target (core 0.12: no
    _allreduce_non_tensor_model_parallel_grads, its TE extensions import only with TE) gets the others."""
    mla_init, self_attention_init, query_key_value, non_tp_grads, have_te = PATCH_TARGETS
    for target, wrapper, why in (
            (mla_init, _wrap_mla_init, "MLA's core attention with k/v head sizes of its own (TE-less)"),
            (self_attention_init, _wrap_mla_self_attention_init, "MLA's q_layernorm: replicated over TP ranks"),
            (query_key_value, _wrap_query_key_value,
             "MLA's k_pos_emb gradient from every TP rank's heads (gathered down projection)"),
            (non_tp_grads, _wrap_non_tp_grads, "MLA's q_layernorm grads summed over TP once, not TP times")):
        if _present(target):
            patcher.wrap(target, wrapper, reason=why)
    try:
        from megatron.core.extensions import transformer_engine
        te_present = transformer_engine.HAVE_TE
    except ImportError:           # core 0.12: the extensions module imports TE itself
        te_present = False
    if not te_present and _present(have_te):
        # MLA imports TE's linears from Megatron's extensions, which hold mocks without TE: the import
        # succeeds, HAVE_TE says True, and MLA's `isinstance(self.linear_proj, TELinear)` raises
        patcher.replace(have_te, False, reason="Transformer Engine absent (MLA read its mocks as TE)")


def _present(target: str) -> bool:
    """Whether the dotted `module.attr[.attr]` exists in the installed Megatron-Core."""
    import importlib
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False
