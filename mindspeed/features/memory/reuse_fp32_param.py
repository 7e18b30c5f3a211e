"""--reuse-fp32-param: bf16 parameters share storage with their fp32 master copies (6 bytes per bf16
parameter become 4; with the distributed optimizer 2 + 4/DP become 2 + 2/DP, DP=1 included).
Framework-free (the matrix imports it); the Megatron-Core hooks are reuse_fp32_param_megatron.py (Float16 optimizer) and
reuse_fp32_param_distrib.py (distributed optimizer), imported only when applied; the MindSpore trainer's is
training/mindspore/reuse_fp32_param.py (with its distributed optimizer only)."""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, switch
from mindspeed.features.host_flags import BF16, NUM_EXPERTS, until_given
from mindspeed.features.registry import register


@register
class ReuseFp32Param(Feature):
    id = "reuse-fp32-param"
    category = "memory"
    description = ("bf16 parameters stored as the high halves of their fp32 master copies (one buffer, "
                   "4 bytes per parameter instead of 2 + 4; with the distributed optimizer 2 + 2/DP "
                   "instead of 2 + 4/DP)")
    flags = (switch("--reuse-fp32-param", "bf16 parameters share storage with the optimizer's fp32 master "
                    "copy (needs --bf16)"),)
    requires = ()        # torch: Megatron-Core's optimizers (always there); MindSpore: the trainer's own
    backends = ("torch", "mindspore")
    depends = ("bf16",)
    # the swap empties and refills the masters' storage, which here is the model's parameters too
    conflicts = ("swap-optimizer",)
    alternatives = "leave it off: bf16 parameters and fp32 masters are kept apart"
    example = ("--reuse-fp32-param", "--bf16")
    examples = {"mindspore": ("--reuse-fp32-param", "--bf16", "--use-distributed-optimizer")}

    def validate(self, args) -> None:
        if args.fp16 or not until_given(args, BF16):
            raise FeatureConfigError("--reuse-fp32-param needs --bf16 (a bf16 value is the high half of an "
                                     "fp32 one; fp16 is not)")
        if args.backend == "mindspore" and not args.use_distributed_optimizer:
            raise FeatureConfigError("--reuse-fp32-param on MindSpore needs --use-distributed-optimizer: its plain "
                                     "optimizer updates the fp32 masters as Parameters owning their storage, so "
                                     "there is no copy to fold away (drop --reuse-fp32-param, or add the flag)")
        if args.use_distributed_optimizer:
            # --overlap-param-gather is fine (reuse_fp32_param_distrib.py: the borrowed halves hold fp32 bits
            # until the deferred all-gather, which the next forward's pre-hooks, a save and a params norm
            # wait for); Megatron-LM's --overlap-param-gather-with-optimizer-step is not with MoE: it starts
            # the all-gather after the first of the chained optimizers' updates, while the expert one's
            # update still turns its buckets into fp32 pairs
            if args.overlap_param_gather_with_optimizer_step and until_given(args, NUM_EXPERTS):
                raise FeatureConfigError("--reuse-fp32-param with --use-distributed-optimizer and MoE: drop "
                                         "--overlap-param-gather-with-optimizer-step (its all-gather would start "
                                         "before the expert optimizer's update)")
            # at data-parallel (or expert-data-parallel) size 1 a rank's master shard is the whole buffer:
            # reuse_fp32_param_distrib.py folds the masters into the buffer's storage grown to twice its size

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            from mindspeed.features.memory import (  # these import torch: feature modules stay framework-free
                reuse_fp32_param_distrib, reuse_fp32_param_megatron)
            reuse_fp32_param_megatron.install(ctx.patcher)      # Float16OptimizerWithFloat16Params
            reuse_fp32_param_distrib.install(ctx.patcher)       # DistributedOptimizer
