"""DualPipeV (feature 'dualpipev', --schedules-method dualpipev): DeepSeek-V3's V-shaped pipeline
schedule. Rank r of PP holds two model chunks, stage r and stage 2PP-1-r, so the embedding and the
loss both sit on rank 0; dualpipev_schedule.py gives each rank's order of work, the torch trainer
runs it (training/dualpipev.py). --dualpipev-dw-detach defers the cool-down's weight gradients into
its bubbles.

The limits are upstream MindSpeed's, refused here in one line before any work.
"""
from __future__ import annotations

import logging

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag, switch
from mindspeed.features.host_flags import host
from mindspeed.features.parallel.dualpipev_schedule import min_microbatches
from mindspeed.features.registry import register

log = logging.getLogger("mindspeed")

SCHEDULE = Flag("--schedules-method", dict(default=None, choices=["dualpipev"],
                                           help="dualpipev: DeepSeek-V3's V-shaped pipeline schedule (2 chunks per "
                                                "pipeline rank, the embedding and the loss on rank 0)"))
UNTIE = host("--untie-embeddings-and-output-weights", False)
# the host's other ways of splitting the layers: the V splits them evenly over its 2 x PP stages
OTHER_SPLITS = (("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage"),
                ("--pipeline-num-transformer-layers", "pipeline_num_transformer_layers"),
                ("--pipeline-model-parallel-layout", "pipeline_model_parallel_layout"),
                ("--num-layer-list", "num_layer_list"),
                ("--decoder-first-pipeline-num-layers", "decoder_first_pipeline_num_layers"),
                ("--decoder-last-pipeline-num-layers", "decoder_last_pipeline_num_layers"))


def _fb_overlap_on(args) -> bool:
    """Megatron-Core's combined forward-backward steps run the V's work (moe-fb-overlap, EP > 1)."""
    return bool(args.moe_fb_overlap or args.overlap_moe_expert_parallel_comm) and \
        (args.expert_model_parallel_size or 1) > 1


def dualpipev_on(args) -> bool:
    return getattr(args, SCHEDULE.dest, None) == "dualpipev"


@register
class DualPipeV(Feature):
    id = "dualpipev"
    category = "parallel"
    optimization_level = 0
    description = "DeepSeek-V3's V-shaped pipeline schedule (two chunks per rank, zero-bubble weight gradients)"
    flags = (SCHEDULE, switch("--dualpipev-dw-detach", "with --schedules-method dualpipev: compute the cool-down's "
                                                       "weight gradients later, in its bubbles"), UNTIE)
    requires = (Cap.SEND_RECV, Cap.PIPELINE_PARALLEL)
    conflicts = ("overlap-grad-reduce", "tp-2d")
    unsupported = {"mindspore": "the MindSpore trainer's pipeline (training/mindspore/pipeline.py) runs its stages "
                                "through exchanges both stages make together; it has no point-to-point sends and "
                                "receives on their own to run the V's per-rank programs: use --backend torch"}
    megatron_lm_refusal = ("DualPipeV runs on the built-in torch trainer (tests_extend/example/pretrain_gpt.py, "
                           "the same flags): Megatron-LM's training loop builds and schedules its model chunks in "
                           "Megatron's interleaved order, not the V")
    alternatives = "leave out --schedules-method: Megatron's 1F1B, or interleaved with virtual stages"
    example = ("--schedules-method", "dualpipev", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
               "--untie-embeddings-and-output-weights", "--global-batch-size", "4", "--micro-batch-size", "1")
    example_world = 2
    inert_example = ("--dualpipev-dw-detach",)

    def enabled(self, args) -> bool:
        return dualpipev_on(args) or args.dualpipev_dw_detach

    def inert(self, args) -> str:
        return "" if dualpipev_on(args) else "without --schedules-method dualpipev there is no V cool-down to detach"

    def validate(self, args) -> None:
        pp = args.pipeline_model_parallel_size or 1
        if pp < 2:
            raise FeatureConfigError(f"--schedules-method dualpipev needs --pipeline-model-parallel-size >= 2, "
                                     f"got {pp}")
        if not args.untie_embeddings_and_output_weights:
            raise FeatureConfigError("--schedules-method dualpipev needs --untie-embeddings-and-output-weights "
                                     "(upstream's limit: no embedding/output weight sharing between the V's ends)")
        if (args.context_parallel_size or 1) > 1:
            raise FeatureConfigError("--schedules-method dualpipev with --context-parallel-size > 1: upstream's "
                                     "limit; drop one")
        given = [name for name, dest in OTHER_SPLITS if getattr(args, dest, None) is not None]
        if given:
            raise FeatureConfigError(f"--schedules-method dualpipev splits the layers evenly over 2 x PP stages "
                                     f"(no virtual stages, no uneven stages): leave out {', '.join(given)}")
        if args.num_layers is not None and args.num_layers % (2 * pp):
            raise FeatureConfigError(f"--schedules-method dualpipev splits --num-layers {args.num_layers} over "
                                     f"2 x PP = {2 * pp} stages: give a multiple of {2 * pp}")
        self._check_microbatches(args, pp)

    def apply(self, ctx, args) -> None:
        if args.dualpipev_dw_detach and _fb_overlap_on(args):
            log.info("MindSpeed: --dualpipev-dw-detach has no effect here: with --moe-fb-overlap Megatron-Core's "
                     "combined forward-backward step computes each backward's weight gradients within it")
        if ctx.backend_name == "torch" and dualpipev_on(args):
            from mindspeed.features.parallel import dualpipev_megatron     # the Megatron-Core hook
            dualpipev_megatron.install(ctx.patcher, args.pipeline_model_parallel_size, mtp=bool(args.mtp_num_layers))

    def _check_microbatches(self, args, pp: int) -> None:
        gbs, mbs = args.global_batch_size, args.micro_batch_size
        if args.rampup_batch_size is not None:
            raise FeatureConfigError("--schedules-method dualpipev with --rampup-batch-size: the V lays out a fixed "
                                     "number of micro-batches per step; drop the ramp-up")
        if not (gbs and mbs):
            return
        n = gbs // (mbs * (args.data_parallel_size or 1))
        if n < min_microbatches(pp):
            raise FeatureConfigError(f"--schedules-method dualpipev at --pipeline-model-parallel-size {pp} needs at "
                                     f"least 2 x PP - 1 = {min_microbatches(pp)} micro-batches per step, got {n}: "
                                     f"raise --global-batch-size")
