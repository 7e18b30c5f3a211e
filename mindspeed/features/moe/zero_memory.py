"""--moe-zero-memory level0|level1 (MindSpeed's flag): the MoE experts' activations are freed in
forward and recomputed in backward, where the chunked all-to-all pipeline of
--moe-alltoall-overlap-comm (or --moe-fb-overlap) hides the recompute under the gradient
all-to-alls still in flight (upstream asks for one of them; so does this row).

* level0: each expert keeps its fc1 output and the routing probabilities only; the activation
  (SwiGLU/GELU) times the probabilities, fc2's input, is freed after fc2 and rebuilt in backward.
* level1: the experts keep only their input tokens and probabilities; fc1, the activation and fc2
  run again in backward (the experts' whole forward).

`--moe-zero-memory-num-layers N`: only the first N transformer layers of each model chunk.
The Megatron-Core hook is zero_memory_megatron.py; the work is the run's backend.memory.
"""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag
from mindspeed.features.moe.features import _dispatcher, expert_parallel
from mindspeed.features.registry import register

LEVELS = ("level0", "level1")


@register
class MoeZeroMemory(Feature):
    id = "moe-zero-memory"
    category = "moe"
    optimization_level = 2
    description = ("MoE experts' activations freed in forward, recomputed in backward under the "
                   "overlapped gradient all-to-alls (level0: activation x probs; level1: the experts' forward)")
    flags = (Flag("--moe-zero-memory", dict(default="disable", choices=("disable",) + LEVELS,
                                            help="level0: recompute the experts' activation x probs in backward; "
                                                 "level1: recompute the experts' whole forward")),
             Flag("--moe-zero-memory-num-layers",
                  dict(type=int, default=None, help="only the first N layers of each model chunk (default: all)")))
    requires = (Cap.MOE, Cap.RECOMPUTE, Cap.RECOMPUTE_OUTPUT)
    depends = ("moe",)
    backends = ("torch",)
    unsupported = {"mindspore": "the MindSpore trainer's MoE layer has no chunked all-to-all pipeline to hide the "
                                "recompute under (its all-to-all is emulated by AllReduce); use "
                                "--recompute-granularity full there"}
    alternatives = "leave it off, or --recompute-granularity full"
    example = ("--moe-zero-memory", "level0", "--moe-alltoall-overlap-comm", "--num-experts", "4",
               "--expert-model-parallel-size", "2")
    example_world = 2

    inert_example = ("--moe-zero-memory", "level0", "--num-experts", "4")
    inert_host_flags = {"moe_zero_memory": "disable"}

    def enabled(self, args) -> bool:
        return args.moe_zero_memory != "disable"

    def inert(self, args) -> str:
        if _dispatcher(args) == "alltoall" and expert_parallel(args) < 2:
            return "at expert parallel size 1 there is no all-to-all to hide the recompute under"
        return ""

    def validate(self, args) -> None:
        level, n, total = args.moe_zero_memory, args.moe_zero_memory_num_layers, args.num_layers
        fb_overlap = args.moe_fb_overlap
        if not (args.moe_alltoall_overlap_comm or fb_overlap):
            raise FeatureConfigError(f"--moe-zero-memory {level} recomputes under the overlapped all-to-alls: "
                                     "add --moe-alltoall-overlap-comm (or --moe-fb-overlap), as upstream")
        if fb_overlap and level == "level1":
            raise FeatureConfigError("--moe-fb-overlap supports --moe-zero-memory level0 only (as upstream)")
        if n is not None and (n < 1 or (total is not None and n > total)):
            raise FeatureConfigError(f"--moe-zero-memory-num-layers must be in 1..--num-layers ({total}), got {n}")
        if args.recompute_granularity == "full":
            raise FeatureConfigError("--moe-zero-memory with --recompute-granularity full: full recompute already "
                                     "keeps no activation inside a layer; use one of them")
        if level == "level0" and args.moe_grouped_gemm:
            raise FeatureConfigError("--moe-zero-memory level0 recomputes each expert MLP's activation; the grouped "
                                     "GEMM experts (--moe-grouped-gemm) have none apart: use level1")

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            from mindspeed.features.moe import zero_memory_megatron   # imports Megatron-Core (.importlinter)
            zero_memory_megatron.install(ctx.patcher, args, ctx.backend.memory)
