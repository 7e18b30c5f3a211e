"""--use-ascend-coc: tensor-parallel linear layers overlap their collectives with their GEMMs,
chunk by chunk (the algorithm: features/parallel/coc.py; the Megatron-Core hook: coc_megatron.py;
the MindSpore trainer's: coc_mindspore.py).

Flag semantics follow MindSpeed upstream: --coc-parallel-num in {1, 2, 4, 8} chunks; --coc-mode
0 the original path, 1 the rewritten path without chunking, 2 chunked overlap, -1 (default) 2
when --coc-parallel-num > 1 else 0. --coc-fused-kernel names Ascend's fused matmul+collective
kernels, which no device here has: refused. In mode 0, or at TP 1, the flag has no effect: accepted
with one line saying so (Feature.inert)."""
from __future__ import annotations

import functools

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag, switch
from mindspeed.features.parallel import coc_megatron
from mindspeed.features.parallel.coc_mindspore import CocLinears
from mindspeed.features.registry import register

PARALLEL_NUMS = (1, 2, 4, 8)
MODES = (-1, 0, 1, 2)


def resolved_mode(args) -> int:
    mode = args.coc_mode
    if mode == -1:
        return 2 if args.coc_parallel_num > 1 else 0
    return mode


def chunks(args) -> int:
    """GEMM pieces per layer: --coc-parallel-num in mode 2, one in mode 1 (rewritten, not split)."""
    return args.coc_parallel_num if resolved_mode(args) == 2 else 1


@register
class AscendCoc(Feature):
    id = "ascend-coc"
    category = "parallel"
    optimization_level = 2
    description = ("tensor-parallel GEMMs split in chunks, each chunk's all-gather / reduce-scatter / "
                   "all-reduce overlapped with the next chunk's GEMM (forward and backward)")
    flags = (switch("--use-ascend-coc", "overlap tensor-parallel communication with the linear layers' GEMMs"),
             Flag("--coc-mode", dict(type=int, default=-1,
                                     help="0 original path, 1 rewritten without chunks, 2 chunked overlap, "
                                          "-1 2 when --coc-parallel-num > 1 else 0")),
             Flag("--coc-parallel-num", dict(type=int, default=1, help="chunks per GEMM: 1, 2, 4 or 8")),
             switch("--coc-fused-kernel", "Ascend's fused matmul+collective kernels (refused: none here)"))
    # torch: Megatron-Core's layers (coc_megatron.py); mindspore: its GPT's (coc_mindspore.py)
    requires = (Cap.ASYNC_COMM, Cap.CUSTOM_OP)
    backends = ("torch", "mindspore")
    alternatives = "leave it off: Megatron's tensor-parallel layers communicate after each GEMM"
    example = ("--use-ascend-coc", "--coc-parallel-num", "2", "--tensor-model-parallel-size", "2")
    example_world = 2

    inert_example = ("--use-ascend-coc", "--coc-parallel-num", "2")      # at TP 1
    # what a run without the flags has (--gradient-accumulation-fusion's check on MindSpore reads it)
    inert_host_flags = {"use_ascend_coc": False, "coc_mode": -1, "coc_parallel_num": 1}

    @staticmethod
    def _bad_value(args) -> str:
        """What is wrong with the flags' own values in any layout ('' if nothing)."""
        if args.coc_fused_kernel:
            return ("--coc-fused-kernel: no fused matmul+collective kernel exists on this device; use "
                    "--coc-parallel-num 2|4|8 (chunked overlap) instead")
        if args.coc_parallel_num not in PARALLEL_NUMS:
            return f"--coc-parallel-num must be 1, 2, 4 or 8, got {args.coc_parallel_num}"
        if args.coc_mode not in MODES:
            return f"--coc-mode must be -1, 0, 1 or 2, got {args.coc_mode}"
        if resolved_mode(args) == 2 and args.coc_parallel_num == 1:
            return "--coc-mode 2 needs --coc-parallel-num 2, 4 or 8 (1 chunk overlaps nothing)"
        return ""

    def inert(self, args) -> str:
        if self._bad_value(args):
            return ""                   # refused by validate, in every layout
        if resolved_mode(args) == 0:
            return "at --coc-mode 0, or the default -1 with --coc-parallel-num 1, the layers run their original path"
        tp = args.tensor_model_parallel_size
        if tp is not None and tp < 2:
            return "at --tensor-model-parallel-size 1 there is no tensor-parallel communication to overlap"
        return ""

    def validate(self, args) -> None:
        bad = self._bad_value(args)
        if bad:
            raise FeatureConfigError(bad)
        if args.defer_embedding_wgrad_compute:
            raise FeatureConfigError("--use-ascend-coc does not combine with --defer-embedding-wgrad-compute")

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            coc_megatron.install(ctx.patcher, ctx.backend, chunks(args))
        else:
            ctx.provide("tensor_parallel_linear", functools.partial(CocLinears, ctx.backend, chunks(args)))
