"""Adaptive recompute (upstream MindSpeed's --adaptive-recompute-device-size): profile the first
steps, then choose per transformer layer whether it keeps its activations or recomputes them in
backward, so that the activations held for backward fit a budget. Framework-free: the profile and
the Megatron-Core hook are adaptive_recompute_megatron.py, the choice adaptive_recompute_plan.py.

The budget is the activation memory of the transformer layers (what the plan can change) for all
micro-batches a pipeline stage holds at once, in MB; the embedding's and the loss's activations,
the parameters, gradients and optimizer states are outside it.
"""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag
from mindspeed.features.registry import register


@register
class AdaptiveRecompute(Feature):
    id = "adaptive-recompute"
    category = "memory"
    description = ("per-layer keep or recompute chosen after profiling the first steps, so that the layers' "
                   "activations fit --adaptive-recompute-device-size MB")
    flags = (Flag("--adaptive-recompute-device-size", dict(type=int, default=-1, help=(
                 "MB the transformer layers' activations held for backward may take (all micro-batches in "
                 "flight); >= 0 turns adaptive recompute on"))),
             Flag("--adaptive-recompute-profiling-step", dict(type=int, default=10, help=(
                 "steps profiled (every layer keeping its activations) before the plan is chosen"))))
    requires = (Cap.RECOMPUTE, Cap.MEGATRON_CORE)
    backends = ("torch",)
    conflicts = ("recompute-activation-function", "recompute-norm", "swap-attention")
    unsupported = {"mindspore": "the MindSpore trainer's recompute (training/mindspore/recompute_plan.py) takes "
                                "Megatron's uniform/block method fixed at launch, and its trainer has no per-layer "
                                "profile of the bytes saved for backward: use the torch backend"}
    alternatives = "--recompute-granularity full --recompute-method block --recompute-num-layers N"
    megatron_lm_refusal = ("adaptive recompute runs on the built-in torch trainer (tests_extend/example/pretrain_gpt.py, "
                           "the same flags): Megatron-LM's training loop tells features no step boundaries, so the "
                           "profiled steps would never end and no layer would recompute")
    example = ("--adaptive-recompute-device-size", "1")

    def enabled(self, args) -> bool:
        size = args.adaptive_recompute_device_size
        return size is not None and size >= 0

    def validate(self, args) -> None:
        steps = args.adaptive_recompute_profiling_step
        if steps is None or steps < 1:
            raise FeatureConfigError(f"--adaptive-recompute-profiling-step must be >= 1, got {steps}")
        if args.recompute_granularity == "full":
            raise FeatureConfigError("--adaptive-recompute-device-size with --recompute-granularity full: both "
                                     "choose which layers recompute; use one of them")
        if args.num_layers_per_virtual_pipeline_stage:
            raise FeatureConfigError("--adaptive-recompute-device-size with --num-layers-per-virtual-pipeline-stage: "
                                     "the plan counts the micro-batches in flight of the 1F1B schedule only; drop "
                                     "the virtual stages or use --recompute-granularity full")

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            from mindspeed.features.memory import adaptive_recompute_megatron  # hook may import Megatron (.importlinter)
            adaptive_recompute_megatron.install(ctx, args)
