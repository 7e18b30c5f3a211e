"""FSDP2 (feature 'torch-fsdp2'): PyTorch's fully_shard over Megatron-Core's GPT instead of DDP and
the distributed optimizer: each parameter, its gradient and its optimizer state sharded along dim 0
over the data-parallel ranks, a layer's weights all-gathered just before it runs.

Flags: Megatron-LM's own `--use-torch-fsdp2` and `--torch-fsdp2-no-reshard-after-forward`, and upstream
MindSpeed's `--fsdp2-config-path` (a YAML of sharding options, mapped or refused key by key in
fsdp2_config.py). The torch hook (fsdp2_megatron.py) wraps each model chunk in Megatron-Core's own
TorchFullyShardedDataParallel; the limits are Megatron-LM's validate_args asserts, refused here
before any work.
"""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag
from mindspeed.features.parallel.fsdp2_config import data_parallel_size, read_config
from mindspeed.features.registry import register

USE = "--use-torch-fsdp2"
CONFIG = "--fsdp2-config-path"


def _megatron_limits(args) -> list[tuple[bool, str]]:
    """Megatron-LM's validate_args asserts for --use-torch-fsdp2 (0.16.1), as (violated, what to do)."""
    return [
        ((args.pipeline_model_parallel_size or 1) > 1,
         "--pipeline-model-parallel-size > 1 (Megatron-LM: not supported with pipeline parallelism); use 1"),
        ((args.expert_model_parallel_size or 1) > 1,
         "--expert-model-parallel-size > 1 (Megatron-LM: not supported with expert parallelism); use 1"),
        (bool(args.use_distributed_optimizer),
         "--use-distributed-optimizer (FSDP2 shards the optimizer states itself); leave it out"),
        (bool(args.gradient_accumulation_fusion),
         "--gradient-accumulation-fusion (it writes into DDP's gradient buffers); leave it out"),
        (args.ckpt_format != "torch_dist",
         f"--ckpt-format {args.ckpt_format} (sharded parameters save as torch_dist); "
         "use --ckpt-format torch_dist"),
        (not args.untie_embeddings_and_output_weights,
         "tied embeddings (the output layer would share a sharded weight); add --untie-embeddings-and-output-weights"),
        (bool(args.fp16), "--fp16 (Megatron-LM: not supported with fp16 yet); use --bf16 or fp32"),
        (bool(args.swiglu) and data_parallel_size(args) % 2 == 1 and data_parallel_size(args) > 1,
         f"--swiglu at an odd data-parallel size {data_parallel_size(args)} (a shard of fc1 would hold rows of "
         "both its gate and up halves, which its checkpoint cannot place); use an even data-parallel size"),
    ]


@register
class TorchFsdp2(Feature):
    id = "torch-fsdp2"
    category = "parallel"
    optimization_level = 0
    description = "fully sharded data parallelism: PyTorch's fully_shard through Megatron-Core's wrapper"
    flags = (
        Flag(USE, dict(action="store_true", default=False,
                       help="shard parameters, gradients and optimizer states over the data-parallel ranks "
                            "(PyTorch FSDP2) instead of DDP"), megatron=True),
        Flag("--torch-fsdp2-no-reshard-after-forward",
             dict(action="store_false", default=True, dest="torch_fsdp2_reshard_after_forward",
                  help="keep each layer's gathered weights from forward to backward (ZeRO-2 style)"), megatron=True),
        Flag(CONFIG, dict(default=None, help="upstream MindSpeed's FSDP2 YAML (sharding_size, "
                                             "reshard_after_forward, param_dtype, ...): each key mapped or refused")),
    )
    requires = (Cap.ALL_GATHER, Cap.REDUCE_SCATTER, Cap.MEGATRON_CORE)
    backends = ("torch",)
    unsupported = {"mindspore": "the MindSpore GPT has no per-parameter sharded data parallelism (PyTorch's "
                                "fully_shard / DTensor); use --use-distributed-optimizer (optimizer states sharded)"}
    alternatives = "use --use-distributed-optimizer (optimizer states sharded over the data-parallel ranks)"
    example = (USE, "--untie-embeddings-and-output-weights", "--global-batch-size", "4")
    example_world = 2
    # the walk's 2 processes at TP 2: data-parallel size 1
    inert_example = (USE, "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", "2")
    inert_host_flags = {"use_torch_fsdp2": False}

    def enabled(self, args) -> bool:
        return bool(args.use_torch_fsdp2) or args.fsdp2_config_path is not None

    def inert(self, args) -> str:
        if data_parallel_size(args) == 1 and args.use_torch_fsdp2 and args.fsdp2_config_path is None:
            return "at data-parallel size 1 there is nothing to shard"
        return ""

    def validate(self, args) -> None:
        if not args.use_torch_fsdp2:
            raise FeatureConfigError(f"{CONFIG} configures FSDP2: add {USE}")
        broken = [what for violated, what in _megatron_limits(args) if violated]
        if broken:
            raise FeatureConfigError(f"{USE} cannot run with {broken[0]}")
        if args.fsdp2_config_path is not None:
            read_config(args.fsdp2_config_path, args)

    def host_values(self, args) -> dict:
        values = {"use_torch_fsdp2": True}
        if args.fsdp2_config_path is not None:
            values.update(read_config(args.fsdp2_config_path, args))
        return values

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            from mindspeed.features.parallel import fsdp2_megatron
            fsdp2_megatron.install(ctx.patcher, ctx.device, bf16=bool(args.bf16))
