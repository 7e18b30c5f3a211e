"""Megatron's own parallelism and memory features, listed so the support matrix covers them and
so a backend that cannot run one refuses it up front. On the torch backend Megatron-Core does
the work itself (no hook needed); on the mindspore backend the native trainer implements them."""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag, switch
from mindspeed.features.registry import register


def _size_flag(name, help):
    return Flag(name, dict(type=int, default=1, help=help), megatron=True)


class _SizeFeature(Feature):
    """A feature that is on when its parallel size flag is above 1."""
    category = "parallel"
    optimization_level = 0

    def enabled(self, args) -> bool:
        return (self.size(args) or 1) > 1

    def size(self, args):
        return getattr(args, self.flags[0].dest)     # the subclass's own size flag

    def validate(self, args) -> None:
        size = self.size(args)
        if size is not None and size < 1:
            raise FeatureConfigError(f"{self.flags[0].name} must be >= 1, got {size}")


@register
class TensorParallel(_SizeFeature):
    id = "tensor-parallel"
    description = "Megatron tensor parallelism"
    flags = (_size_flag("--tensor-model-parallel-size", "tensor-parallel size"),)
    requires = (Cap.ALL_REDUCE, Cap.ALL_GATHER, Cap.SUBGROUPS)
    example, example_world = ("--tensor-model-parallel-size", "2"), 2


@register
class PipelineParallel(_SizeFeature):
    id = "pipeline-parallel"
    description = "Megatron pipeline parallelism (1F1B)"
    flags = (_size_flag("--pipeline-model-parallel-size", "pipeline-parallel size"),)
    requires = (Cap.SEND_RECV, Cap.PIPELINE_PARALLEL)
    example = ("--pipeline-model-parallel-size", "2")
    example_world = 2
    alternatives = "use --tensor-model-parallel-size or data parallelism instead"

    def validate(self, args) -> None:
        super().validate(args)
        problem = virtual_pipeline_problem(args) or (
            mindspore_pipeline_problem(args) if args.backend == "mindspore" else None)
        if problem:
            raise FeatureConfigError(problem)


def virtual_pipeline_problem(args) -> str | None:
    """Megatron-Core's interleaved schedule raises at the first step whose micro-batches it cannot
    group (schedules.py): refused here for every global batch size --rampup-batch-size goes through."""
    if args.num_layers_per_virtual_pipeline_stage is None and not _unaligned_virtual_stages(args):
        return None
    gbs, mbs = args.global_batch_size, args.micro_batch_size
    dp = args.data_parallel_size or 1
    rampup = args.rampup_batch_size
    sizes = [gbs] if rampup is None else list(range(int(rampup[0]), gbs, int(rampup[1]) or gbs)) + [gbs]
    for size in (sizes if gbs and mbs else []):
        problem = interleaved_micro_batch_problem(size // (mbs * dp), args.pipeline_model_parallel_size)
        if problem:
            return problem
    return None


def mindspore_pipeline_problem(args) -> str | None:
    """What the MindSpore trainer's pipeline (training/mindspore/pipeline.py) cannot run, in one line."""
    pp = args.pipeline_model_parallel_size
    if pp != 2:
        return (f"--pipeline-model-parallel-size {pp}: the MindSpore trainer's 1F1B runs 2 stages (on CPU its "
                "transfers are exchanges both stages make together); use 2")
    if (args.context_parallel_size or 1) > 1:
        return ("--context-parallel-size with --pipeline-model-parallel-size: the MindSpore trainer runs one "
                "or the other; use --backend torch for both")
    return None


def _unaligned_virtual_stages(args) -> bool:
    """Whether --pipeline-num-transformer-layers / --pipeline-model-parallel-layout give virtual stages."""
    from mindspeed.features.parallel.pipeline_layout import LayoutSyntaxError
    from mindspeed.features.parallel.unaligned_pipeline import layer_matrix
    try:
        rows = layer_matrix(args)
    except LayoutSyntaxError:
        return False          # the unaligned-pipeline feature refuses it
    return bool(rows) and len(rows[0]) > 1


def interleaved_micro_batch_problem(n: int, pp: int) -> str | None:
    """Megatron-Core's rule for its interleaved schedule (micro-batches in groups of PP per model
    chunk): the MindSpore trainer's (training/mindspore/interleaved.py) follows it too."""
    if n < pp or n % pp:
        return (f"{n} micro-batches per step: the interleaved schedule (virtual pipeline stages) needs a "
                f"multiple of --pipeline-model-parallel-size {pp}, as Megatron-Core's; change "
                "--global-batch-size or --micro-batch-size")
    return None


@register
class ExpertParallel(_SizeFeature):
    id = "expert-parallel"
    description = "Megatron-Core MoE expert parallelism"
    flags = (_size_flag("--expert-model-parallel-size", "expert-parallel size"),)
    requires = (Cap.ALL_TO_ALL, Cap.MOE)
    alternatives = "leave --expert-model-parallel-size at 1 (every rank holds every expert)"
    example, example_world = ("--expert-model-parallel-size", "2", "--num-experts", "4"), 2


@register
class SequenceParallel(Feature):
    id = "sequence-parallel"
    category = "parallel"
    optimization_level = 0
    description = "Megatron sequence parallelism (norms/dropout sharded along the sequence)"
    flags = (Flag("--sequence-parallel", dict(action="store_true", default=False,
                                             help="shard activations along the sequence inside TP"),
                  megatron=True),)
    requires = (Cap.ALL_GATHER, Cap.REDUCE_SCATTER)
    example, example_world = ("--tensor-model-parallel-size", "2", "--sequence-parallel"), 2

    inert_host_flags = {"sequence_parallel": False}     # Megatron-Core's TransformerConfig refuses it at TP 1
    inert_example = ("--sequence-parallel",)

    def inert(self, args) -> str:
        if (args.tensor_model_parallel_size or 1) < 2:
            return ("at --tensor-model-parallel-size 1 there is no tensor-parallel group to shard the sequence "
                    "over (Megatron turns it off too)")
        return ""


@register
class DistributedOptimizer(Feature):
    id = "distributed-optimizer"
    category = "parallel"
    optimization_level = 0
    description = "ZeRO-1 style optimizer-state sharding across data-parallel ranks"
    flags = (Flag("--use-distributed-optimizer", dict(action="store_true", default=False,
                                                     help="shard optimizer state over DP"),
                  megatron=True),)
    requires = (Cap.REDUCE_SCATTER, Cap.ALL_GATHER, Cap.DISTRIBUTED_OPTIMIZER)
    example, example_world = ("--use-distributed-optimizer",), 2
    backends = ("torch", "mindspore")
    alternatives = "drop --use-distributed-optimizer (plain data parallelism works on every backend)"


@register
class Recompute(Feature):
    id = "recompute"
    category = "memory"
    optimization_level = 0
    description = "Megatron activation recompute (full or selective)"
    flags = (Flag("--recompute-granularity", dict(choices=["full", "selective"], default=None,
                                                 help="recompute activations in backward"), megatron=True),
             Flag("--recompute-method", dict(choices=["uniform", "block"], default=None,
                                            help="how layers are grouped for full recompute"), megatron=True),
             Flag("--recompute-num-layers", dict(type=int, default=None,
                                                help="layers per recompute group / block"), megatron=True))
    requires = (Cap.RECOMPUTE,)
    example = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")

    def enabled(self, args) -> bool:
        return args.recompute_granularity is not None

    def validate(self, args) -> None:
        if args.recompute_granularity == "full" and not args.recompute_method:
            raise FeatureConfigError("--recompute-granularity full needs --recompute-method uniform|block")
