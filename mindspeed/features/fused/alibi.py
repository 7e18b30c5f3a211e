"""--position-embedding-type alibi: attention with linear biases (Press et al.) instead of position
embeddings. Megatron-Core's model gets no position embedding ('none'); MindSpeed's attention module in
the layer spec adds, per head h of H, the bias -m_h * |i - j| to the scaled scores (flash_attention.py:
the fused kernel's alibi input with --use-flash-attn, else its own softmax path).

Slopes: m_h = 2^(-8(h+1)/H) for H a power of two; otherwise those of the nearest lower power of two P,
then every other slope of 2P (the ALiBi paper's interpolation). At TP > 1 each rank's heads keep the
slopes of their global indices.

Upstream's flags: --alibi-diagonal-opposite makes the bias -m_h * (i - j) (positive above the diagonal,
the same under a causal mask); --alibi-fusion-attn-type 0 (the bias as a tensor) or 2 (generated from
the slopes in the kernel) are one bias here; --square-alibi-mask (a square bias rather than npu's last
1024 rows) is what MindSpeed's kernels always take; --fill-neg-inf masks with -inf instead of Megatron's
-10000 in the unfused softmax. Framework-free: the torch parts live in flash_attention.py.
"""
from __future__ import annotations

import math

from mindspeed.features.base import Feature, FeatureConfigError, Flag, switch
from mindspeed.features.host_flags import host
from mindspeed.features.registry import register

ALIBI = "alibi"
FUSION_ATTN_TYPES = (0, 2)


def slopes(num_heads: int) -> list[float]:
    """The ALiBi slope of each of `num_heads` heads (global head order)."""
    if num_heads < 1:
        raise ValueError(f"alibi needs at least one head, not {num_heads}")
    power = 2 ** math.floor(math.log2(num_heads))
    base = [2.0 ** (-8.0 * (h + 1) / power) for h in range(power)]
    if power == num_heads:
        return base
    return base + slopes(2 * power)[0::2][:num_heads - power]


def local_slopes(num_heads: int, tp_size: int, tp_rank: int) -> list[float]:
    """The slopes of the heads TP rank `tp_rank` of `tp_size` holds (a contiguous block of global heads)."""
    per_rank = num_heads // tp_size
    return slopes(num_heads)[tp_rank * per_rank:(tp_rank + 1) * per_rank]


@register
class Alibi(Feature):
    id = ALIBI
    category = "fused"
    optimization_level = 0       # the model's positions: never dropped by --optimization-level
    description = ("ALiBi: per-head linear attention biases -m_h|i-j| instead of position embeddings, in "
                   "MindSpeed's attention (the fused kernel's alibi input with --use-flash-attn)")
    flags = (
        host("--position-embedding-type", "rope"),
        Flag("--alibi-fusion-attn-type", dict(type=int, default=None,
                                              help="alibi in the fused attention: 0 a bias tensor, 2 from the "
                                                   "slopes (the same bias here)")),
        switch("--alibi-diagonal-opposite", "alibi bias -m(i-j) (positive above the diagonal), not -m|i-j|"),
        switch("--square-alibi-mask", "a square [s, s] alibi bias (MindSpeed's kernels always take one)"),
        switch("--fill-neg-inf", "alibi without flash attention: masked scores -inf, not -10000"),
    )
    example = ("--position-embedding-type", "alibi")
    unsupported = {"mindspore": "the MindSpore trainer's attention (training/mindspore/layers.py) adds no "
                                "per-head position bias: use --backend torch"}
    megatron_lm_refusal = ("Megatron-LM's own attention has no alibi bias: run alibi on MindSpeed's built-in "
                           "trainer (tests_extend/example/pretrain_gpt.py)")
    alternatives = "--position-embedding-type rope (or learned_absolute)"

    def on_hint(self) -> str:
        return "--position-embedding-type alibi"

    def enabled(self, args) -> bool:
        return getattr(args, "position_embedding_type", None) == ALIBI or any(
            getattr(args, fl.dest, fl.default) not in (fl.default, None) for fl in self.flags[1:])

    def trigger(self, args) -> str:
        if getattr(args, "position_embedding_type", None) == ALIBI:
            return "--position-embedding-type alibi"
        return super().trigger(args)

    def validate(self, args) -> None:
        if args.position_embedding_type != ALIBI:
            raise FeatureConfigError(f"{self.typed_flags(args)[-1]} needs --position-embedding-type alibi")
        kind = args.alibi_fusion_attn_type
        if kind is not None and kind not in FUSION_ATTN_TYPES:
            raise FeatureConfigError(f"--alibi-fusion-attn-type {kind} is not supported; choose one of "
                                     f"{', '.join(map(str, FUSION_ATTN_TYPES))} (3, sqrt distances, is not "
                                     "implemented)")
        if kind is not None and not getattr(args, "use_flash_attn", False):
            raise FeatureConfigError(f"--alibi-fusion-attn-type {kind} picks the fused attention's alibi: "
                                     "it needs --use-flash-attn")
        if (args.context_parallel_size or 1) > 1:
            raise FeatureConfigError("--position-embedding-type alibi with --context-parallel-size > 1: the "
                                     "context-parallel attention adds no alibi bias yet; use --context-parallel-size 1")
        if args.backend == "torch" and getattr(args, "multi_latent_attention", False):
            raise FeatureConfigError("--position-embedding-type alibi with --multi-latent-attention: multi-latent "
                                     "attention has its own (decoupled RoPE) positions; drop one")

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            from mindspeed.features.fused import flash_attention
            flash_attention.install_alibi(ctx, args)
