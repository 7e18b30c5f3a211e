"""Recompute scheduled into the pipeline bubble (upstream MindSpeed's "recompute independent
pipelining"): the recomputation of a micro-batch's layers runs while its stage waits for that
micro-batch's gradient, not after it has arrived. Framework-free; the work is
recompute_in_bubble_megatron.py.

* --recompute-in-advance: with Megatron's full recompute (--recompute-granularity full
  --recompute-method block), the recomputation moves from the backward into the wait before it.
* --recompute-in-bubble: without a recompute of the user's, every stage but the last checkpoints
  all its layers (holding only their inputs for the micro-batches in flight) and rebuilds each
  micro-batch in that wait: the memory of full recompute with the recomputation off the critical path.
  The last stage waits for no gradient (its backward follows its forward): it keeps its activations.

Upstream runs both on the interleaved (virtual pipeline) schedule only; here they run on Megatron-Core's
1F1B schedule (pipeline parallelism without virtual stages).
"""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, switch
from mindspeed.features.registry import register

IN_ADVANCE, IN_BUBBLE = "--recompute-in-advance", "--recompute-in-bubble"


@register
class RecomputeInBubble(Feature):
    id = "recompute-in-bubble"
    category = "memory"
    description = ("pipeline recomputation run while a stage waits for the micro-batch's gradient (the bubble), "
                   "not after it arrives")
    flags = (switch(IN_BUBBLE, "checkpoint every layer of the non-last pipeline stages and recompute each "
                               "micro-batch in the bubble before its gradient arrives"),
             switch(IN_ADVANCE, "with --recompute-granularity full --recompute-method block: recompute in the "
                                "bubble before the gradient arrives instead of after"))
    requires = (Cap.RECOMPUTE, Cap.PIPELINE_PARALLEL, Cap.MEGATRON_CORE)
    backends = ("torch",)
    conflicts = ("adaptive-recompute", "recompute-activation-function", "recompute-norm", "swap-attention")
    unsupported = {"mindspore": "it posts the gradient's receive ahead of its wait; MindSpore 2.10 has no "
                                "point-to-point receive on CPU (comm.send_recv is a collective exchange both "
                                "stages call together, training/mindspore/pipeline.py), and its first stage "
                                "reruns the forward under vjp only right before the backward (PyNative keeps "
                                "one pending backward graph per function): use the torch backend"}
    alternatives = "--recompute-granularity full --recompute-method block --recompute-num-layers N"
    example = (IN_BUBBLE, "--pipeline-model-parallel-size", "2")
    example_world = 2
    inert_example = (IN_BUBBLE,)

    def enabled(self, args) -> bool:
        return bool(args.recompute_in_bubble or args.recompute_in_advance)

    def inert(self, args) -> str:
        if (args.pipeline_model_parallel_size or 1) < 2:
            return "at --pipeline-model-parallel-size 1 there is no pipeline bubble to recompute in"
        return ""

    def validate(self, args) -> None:
        if args.recompute_in_bubble and args.recompute_in_advance:
            raise FeatureConfigError(f"{IN_BUBBLE} with {IN_ADVANCE}: in-bubble checkpoints the layers itself, "
                                     "in-advance moves your own full recompute; use one of them")
        if args.num_layers_per_virtual_pipeline_stage:
            raise FeatureConfigError(f"{self.trigger(args)} with --num-layers-per-virtual-pipeline-stage: only "
                                     "the 1F1B schedule (no virtual stages) is covered; drop the virtual stages")
        if args.recompute_in_bubble and args.recompute_granularity:
            raise FeatureConfigError(f"{IN_BUBBLE} with --recompute-granularity {args.recompute_granularity}: "
                                     f"in-bubble chooses the recompute itself; drop it, or use {IN_ADVANCE}")
        if args.recompute_in_advance and (args.recompute_granularity != "full" or args.recompute_method != "block"):
            raise FeatureConfigError(f"{IN_ADVANCE} needs --recompute-granularity full --recompute-method block "
                                     f"(got {args.recompute_granularity} / {args.recompute_method}): it moves "
                                     "that recomputation into the bubble")

    def apply(self, ctx, args) -> None:
        if ctx.backend_name != "torch":
            return
        from mindspeed.features.memory import recompute_in_bubble_megatron   # hook may import Megatron (.importlinter)
        ctx.provide("recompute_in_bubble", recompute_in_bubble_megatron.install(ctx.patcher))
        if args.recompute_in_bubble:
            recompute_in_bubble_megatron.checkpoint_every_layer(ctx.patcher)
