"""--quant-grads (upstream MindSpeed's gradient quantization): Megatron-Core's grad buffer held in fp16, each
parameter's gradient at its own power-of-two scale (quant_grads_megatron.py). A feature of its own beside
--quant-states (quant_states.py): the two combine, and each is inert or refused on its own terms (with
--optimizer sgd the moments' half has nothing to hold; the gradients' half still runs).
"""
from __future__ import annotations

from mindspeed.features.base import Feature, FeatureConfigError, switch
from mindspeed.features.registry import register

QUANT_GRADS_LIMITS = (
    ("use_torch_fsdp2", "--quant-grads with --use-torch-fsdp2: FSDP2 reduces its own gradients, not through "
                        "Megatron-Core's grad buffer that --quant-grads holds in fp16; drop one of them"),
    ("sequence_parallel", "--quant-grads with --sequence-parallel: the layer norms' gradients are summed over "
                          "tensor-parallel ranks whose per-tensor fp16 scales differ; drop one of them"),
    ("use_precision_aware_optimizer", "--quant-grads with --use-precision-aware-optimizer: that optimizer reads "
                                      "the grad buffer itself, unscaled; drop one of them"),
)
QUANT_GRADS_PP_REFUSAL = ("--quant-grads with --pipeline-model-parallel-size > 1: the tied embedding's gradients "
                          "are summed over the first and last stages, whose per-tensor fp16 scales differ; "
                          "drop one of them")


@register
class QuantGrads(Feature):
    id = "quant-grads"
    category = "memory"
    description = "gradients held in fp16 in Megatron-Core's grad buffer, each at its own power-of-two scale"
    flags = (switch("--quant-grads", "hold gradients in fp16 in the grad buffer, each at its own power-of-two scale "
                    "(upstream's --quant-grads; with --quant-states or alone)"),)
    # as --quant-states: fused EMA AdamW is another optimizer (upstream's is its own class), and upstream
    # refuses --swap-optimizer with its low-precision optimizer
    conflicts = ("swap-optimizer", "fused-ema-adamw")
    optimization_level = 0
    backends = ("torch",)
    # not a MindSpore gap: the trainer's gradients (its traced graph's, main_grad.py's fp32 buffers) are not
    # wired for fp16 storage yet
    unsupported = {"mindspore": "the MindSpore trainer keeps its gradients in fp32 (its traced graph's outputs and "
                                "fp32 main-grad buffers) with no fp16 store at per-tensor scales yet: use --backend torch"}
    alternatives = "drop --quant-grads: the gradients stay fp32"
    example = ("--quant-grads",)

    def enabled(self, args) -> bool:
        return bool(args.quant_grads)

    def validate(self, args) -> None:
        for dest, refusal in QUANT_GRADS_LIMITS:
            if getattr(args, dest, False):
                raise FeatureConfigError(refusal)
        if args.pipeline_model_parallel_size > 1:
            raise FeatureConfigError(QUANT_GRADS_PP_REFUSAL)

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            from mindspeed.features.training import quant_grads_megatron
            quant_grads_megatron.install(ctx.patcher)
