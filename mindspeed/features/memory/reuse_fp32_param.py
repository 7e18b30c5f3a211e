"""--reuse-fp32-param: bf16 parameters share storage with their fp32 master copies (6 bytes per bf16
parameter become 4). Framework-free (the matrix imports it); the Megatron-Core hook is
reuse_fp32_param_megatron.py, imported only when applied."""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, switch
from mindspeed.features.registry import register


@register
class ReuseFp32Param(Feature):
    id = "reuse-fp32-param"
    category = "memory"
    description = ("bf16 parameters stored as the high halves of their fp32 master copies (one buffer, "
                   "4 bytes per parameter instead of 2 + 4)")
    flags = (switch("--reuse-fp32-param", "bf16 parameters share storage with the optimizer's fp32 master "
                    "copy (needs --bf16)"),)
    requires = (Cap.MEGATRON_CORE,)
    backends = ("torch",)
    depends = ("mixed-precision",)
    # the swap empties and refills the masters' storage, which here is the model's parameters too
    conflicts = ("swap-optimizer",)
    unsupported = {"mindspore": "the MindSpore trainer trains in fp32 (it refuses --bf16: MindSpore's CPU "
                                "kernels have no bf16 matmul here), so there is no bf16 copy to fold into "
                                "the master; use --backend torch"}
    alternatives = "leave it off: bf16 parameters and fp32 masters are kept apart"
    example = ("--reuse-fp32-param", "--bf16")

    def validate(self, args) -> None:
        if getattr(args, "fp16", False) or not getattr(args, "bf16", False):
            raise FeatureConfigError("--reuse-fp32-param needs --bf16 (a bf16 value is the high half of an "
                                     "fp32 one; fp16 is not)")
        if getattr(args, "use_distributed_optimizer", False):
            raise FeatureConfigError("--reuse-fp32-param with --use-distributed-optimizer is not supported yet "
                                     "(its masters are shards of DDP's parameter buffer): drop "
                                     "--use-distributed-optimizer to use Megatron's Float16 optimizer")

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            from mindspeed.features.memory import reuse_fp32_param_megatron
            reuse_fp32_param_megatron.install(ctx.patcher)
