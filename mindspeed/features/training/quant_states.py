"""--quant-states fp8 | mxfp8 (upstream MindSpeed's low-precision optimizer): Adam's two moments held in
8 bits between updates (formats in quantized_moments.py; the Megatron-Core hook in
quant_states_megatron.py). hif8 is refused: see HIF8_REFUSAL. Its companion --quant-grads is a feature of
its own (quant_grads.py), so that each is inert or refused on its own terms.
"""
from __future__ import annotations

from mindspeed.features.base import Feature, FeatureConfigError, Flag
from mindspeed.features.registry import register

FORMATS = ("fp8", "hif8", "mxfp8")
HIF8_REFUSAL = ("--quant-states hif8: HiFloat8 has no encoder here to match: torch has no hifloat8 dtype, "
                "MindSpore 2.10's hifloat8 has no CPU cast, and upstream encodes it with torch_npu's "
                "HiFloat8Tensor, whose rounding an encoder written here could not be checked against; "
                "use --quant-states fp8 or mxfp8")
@register
class QuantStates(Feature):
    id = "quant-states"
    category = "memory"
    description = "Adam's moments held in 8 bits between updates (fp8: e4m3/e5m2 with per-block scales; mxfp8: OCP MX)"
    flags = (Flag("--quant-states", dict(choices=FORMATS, default=None, help=(
                 "hold Adam's moments in 8 bits between updates: fp8 (exp_avg e4m3, exp_avg_sq e5m2, fp32 scale "
                 "per block of gcd(numel, 128)) or mxfp8 (OCP MX blocks of 32, E8M0 scales); hif8 is refused"))),)
    # upstream refuses --swap-optimizer with it; fused EMA AdamW is another optimizer (upstream's is its own
    # class) whose step hooks would run once per parameter here
    conflicts = ("swap-optimizer", "fused-ema-adamw")
    optimization_level = 0
    backends = ("torch",)
    unsupported = {"mindspore": "MindSpore 2.10 has no CPU cast to float8_e4m3fn / float8_e5m2 (nor hifloat8), "
                                "and the MindSpore trainer's Adam (the fused AdamWeightDecay kernel) updates its "
                                "moments as fp32 Parameters in place: it has no 8-bit moment store; use --backend torch"}
    alternatives = "--swap-optimizer (the moments in host memory), or --use-distributed-optimizer (the moments split over data-parallel ranks)"
    example = ("--quant-states", "fp8")
    inert_example = ("--quant-states", "fp8", "--optimizer", "sgd")

    def enabled(self, args) -> bool:
        return bool(args.quant_states)

    def validate(self, args) -> None:
        if args.quant_states == "hif8":
            raise FeatureConfigError(HIF8_REFUSAL)

    def inert(self, args) -> str:
        if getattr(args, "optimizer", "adam") != "adam":
            return f"--quant-states with --optimizer {args.optimizer}: only Adam's moments are quantized (as upstream)"
        return ""

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            from mindspeed.features.training import quant_states_megatron
            quant_states_megatron.install(ctx.patcher, args)
