"""2-D tensor parallelism (feature 'tp-2d', --tp-2d --tp-x X --tp-y Y): the TP ranks form an X-by-Y
grid (TP = X * Y); activations between layers are sharded on both axes ([s/X, b, h/Y]) and each linear
layer's all-gather and reduce-scatter run over one sub-group each (tp2d_ops.py: the algorithm against
the backend interface; tp2d_megatron.py: Megatron-Core's GPT on the torch trainer). A collective over
X or Y ranks moves less than Megatron's over all TP ranks (docs/tp-2d.md, tests_extend/benchmarks/bench_tp2d.py).

The limits are upstream MindSpeed's (no MoE, no sequence parallelism, no fused RMSNorm, no CoC) and
this implementation's own (no context parallelism, no MLA/MTP), each refused in one line before any work.
"""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag, switch
from mindspeed.features.host_flags import NUM_EXPERTS, until_given
from mindspeed.features.registry import register

FLAG = "--tp-2d"


def _divides(args, name: str, value, by: int, what: str) -> None:
    if value and value % by:
        raise FeatureConfigError(f"{FLAG}: {name} {value} must divide by {what} = {by}")


@register
class TensorParallel2D(Feature):
    id = "tp-2d"
    category = "parallel"
    optimization_level = 2
    description = ("tensor parallelism over an x-by-y grid: activations sharded on both axes, each linear's "
                   "all-gather and reduce-scatter over the x or the y sub-group")
    flags = (switch(FLAG, "2-D tensor parallelism: the TP ranks as a --tp-x by --tp-y grid"),
             Flag("--tp-x", dict(type=int, default=1, help="with --tp-2d: the grid's first axis (sequence "
                                                           "between layers); --tp-x x --tp-y = TP")),
             Flag("--tp-y", dict(type=int, default=1, help="with --tp-2d: the grid's second axis (hidden "
                                                           "size between layers)")))
    requires = (Cap.ALL_GATHER, Cap.REDUCE_SCATTER, Cap.ALL_TO_ALL, Cap.SUBGROUPS, Cap.CUSTOM_OP, Cap.MEGATRON_CORE)
    backends = ("torch",)
    conflicts = ("fused-rmsnorm", "ascend-coc", "dualpipev")
    unsupported = {"mindspore": "the MindSpore trainer's GPT (training/mindspore) has no 2-D layers, and on CPU its "
                                "collectives have no native ReduceScatter or sub-group AllGather (both emulated by "
                                "an AllReduce of the whole tensor: no volume saved); use --backend torch"}
    megatron_lm_refusal = ("2-D TP runs on the built-in torch trainer (tests_extend/example/pretrain_gpt.py, the "
                           "same flags); inside Megatron-LM's pretrain_gpt.py it is not verified yet (its default "
                           "Transformer Engine layers are not the ones the grid converts)")
    alternatives = "plain --tensor-model-parallel-size (1-D TP), with --sequence-parallel"
    example = (FLAG, "--tp-x", "2", "--tp-y", "1", "--tensor-model-parallel-size", "2")
    example_world = 2
    inert_example = ("--tp-x", "2", "--tp-y", "2")

    def enabled(self, args) -> bool:
        return bool(args.tp_2d) or args.tp_x != 1 or args.tp_y != 1

    def inert(self, args) -> str:
        return "" if args.tp_2d else "without --tp-2d the TP ranks form no grid: --tp-x/--tp-y have no effect"

    def validate(self, args) -> None:
        tp = args.tensor_model_parallel_size or 1
        x, y = args.tp_x, args.tp_y
        if x < 1 or y < 1 or x * y != tp:
            raise FeatureConfigError(f"{FLAG} needs --tp-x x --tp-y = --tensor-model-parallel-size: "
                                     f"{x} x {y} != {tp}")
        refused = [(args.sequence_parallel, "--sequence-parallel (the grid already shards "
                    "the sequence over --tp-x; upstream's limit)"),
                   (until_given(args, NUM_EXPERTS), "MoE (--num-experts: upstream's limit; the experts keep "
                    "1-D TP)"),
                   ((args.context_parallel_size or 1) > 1, "--context-parallel-size > 1 (upstream "
                    "joins CP to the y axis; not built here)"),
                   (args.multi_latent_attention, "--multi-latent-attention (only Megatron's "
                    "SelfAttention has 2-D layers)"),
                   (args.mtp_num_layers, "--mtp-num-layers (the MTP block has no 2-D layers)")]
        for on, what in refused:
            if on:
                raise FeatureConfigError(f"{FLAG} cannot run with {what}")
        self._check_sizes(args, tp, x, y)

    def _check_sizes(self, args, tp: int, x: int, y: int) -> None:
        heads = args.num_attention_heads
        groups = args.num_query_groups if args.group_query_attention else heads
        _divides(args, "--num-query-groups" if groups != heads else "--num-attention-heads", groups, tp,
                 "TP (whole head groups per rank after the all-to-all over --tp-y)")
        # hidden = heads x head size then divides by TP too; the FFN size does under plain TP already
        _divides(args, "--seq-length", args.seq_length, tp,
                 "TP (the sequence is split over --tp-x and over --tp-y)")

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch" and args.tp_2d:
            from mindspeed.features.parallel import tp2d_megatron
            tp2d_megatron.install(ctx.patcher, ctx.backend, args.tp_x, args.tp_y)
