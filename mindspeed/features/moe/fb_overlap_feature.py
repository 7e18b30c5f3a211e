"""--moe-fb-overlap (MindSpeed upstream's name) and Megatron-Core 0.16's own
--overlap-moe-expert-parallel-comm / --delay-wgrad-compute: one micro-batch's MoE all-to-alls
overlapped with another micro-batch's compute, by Megatron-Core's combined-1F1B schedule
(pipeline_parallel/combined_1f1b.py). The hook is fb_overlap.py; the refusals follow Megatron's
TransformerConfig checks and upstream's, each as one line before any work.
"""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag, switch
from mindspeed.features.moe.features import _dispatcher
from mindspeed.features.registry import register
from mindspeed.versions import megatron_version

FB_OVERLAP = switch("--moe-fb-overlap", "overlap one micro-batch's MoE all-to-alls with another micro-batch's "
                                        "forward/backward compute (Megatron-Core's combined 1F1B schedule)")
# Megatron-LM 0.16's own flags (its parser has them; the built-in trainer's gets them from here)
MEGATRON_OVERLAP = Flag("--overlap-moe-expert-parallel-comm", dict(
    action="store_true", help="Megatron-Core 0.16's name of --moe-fb-overlap"), megatron=True)
DELAY_WGRAD = Flag("--delay-wgrad-compute", dict(
    action="store_true", help="defer weight gradients within the overlapped schedule (Transformer Engine "
                              "layers only: the local layers compute them in the backward)"), megatron=True)
COMBINED_1F1B = "megatron.core.pipeline_parallel.combined_1f1b"      # Megatron-Core >= 0.14's schedule


def _megatron_lacks(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:          # no Megatron-Core at all: the matrix refuses that itself
        return False


@register
class MoeFbOverlap(Feature):
    id = "moe-fb-overlap"
    category = "moe"
    optimization_level = 2
    description = ("one micro-batch's MoE all-to-alls overlapped with another's forward/backward compute "
                   "(Megatron-Core's combined 1F1B)")
    flags = (FB_OVERLAP, MEGATRON_OVERLAP, DELAY_WGRAD)
    requires = (Cap.MOE, Cap.ASYNC_COMM, Cap.ALL_TO_ALL)
    depends = ("moe",)
    backends = ("torch",)
    alternatives = ("leave it off: each micro-batch's all-to-alls run between its own compute "
                    "(--moe-alltoall-overlap-comm overlaps them within one micro-batch)")
    unsupported = {"mindspore": "the MindSpore trainer has no asynchronous all-to-all to overlap (MindSpore's CPU "
                                "collectives lack AlltoAll: its backend builds one from AllReduce) and no "
                                "combined-1F1B schedule; use the torch backend"}
    example = ("--moe-fb-overlap", "--num-experts", "4", "--expert-model-parallel-size", "2")
    example_world = 2
    inert_example = ("--moe-fb-overlap", "--num-experts", "4")
    before_host_checks = True          # Megatron-LM's args show its own flag on, as its forward_step needs
    inert_host_flags = {"moe_fb_overlap": False, "overlap_moe_expert_parallel_comm": False,
                        "delay_wgrad_compute": False}

    def enabled(self, args) -> bool:
        return any(bool(getattr(args, fl.dest, False)) for fl in self.flags)

    def inert(self, args) -> str:
        if (args.expert_model_parallel_size or 1) < 2 and self._overlap_on(args):
            return "at --expert-model-parallel-size 1 there is no all-to-all to overlap"
        return ""

    @staticmethod
    def _overlap_on(args) -> bool:
        return bool(args.moe_fb_overlap or args.overlap_moe_expert_parallel_comm)

    def validate(self, args) -> None:
        if not self._overlap_on(args):
            raise FeatureConfigError("--delay-wgrad-compute needs --moe-fb-overlap (or --overlap-moe-expert-"
                                     "parallel-comm): it defers weight gradients inside the overlapped schedule")
        if self.inert(args):                # Megatron-LM's early pass (before_host_checks) sees EP 1 too
            return
        name = self.trigger(args)
        if args.backend != "mindspore" and _megatron_lacks(COMBINED_1F1B):
            raise FeatureConfigError(f"{name} runs Megatron-Core's combined 1F1B schedule, which Megatron-Core "
                                     f"{megatron_version()} lacks: use Megatron-LM core_v0.16.1, or drop the flag")
        for refusal in _layout_refusals(args):
            if refusal:
                raise FeatureConfigError(f"{name} {refusal}")

    def host_values(self, args) -> dict:
        # Megatron-LM's pretrain_gpt.py builds the schedule plan only under its own flag; its config takes
        # the field after its checks (fb_overlap.install). --delay-wgrad-compute: Megatron-LM asks for
        # Transformer Engine, and the local layers compute weight gradients in the backward anyway
        return {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": False}

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            from mindspeed.features.moe import fb_overlap
            fb_overlap.install(ctx.patcher, ctx.backend, delay_wgrad=bool(args.delay_wgrad_compute))
            from mindspeed.features.moe import fb_overlap_recompute
            fb_overlap_recompute.install(ctx.patcher, args)


def _layout_refusals(args):
    """Each combination Megatron-Core's combined 1F1B (or upstream) cannot run, as the rest of a line."""
    pp, vpp = args.pipeline_model_parallel_size or 1, args.num_layers_per_virtual_pipeline_stage
    # DualPipeV runs the combined steps itself (training/dualpipev.py), in the V's F-B slots
    interleaved = vpp or getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    yield (f"at --pipeline-model-parallel-size {pp} needs the interleaved schedule "
           "(--num-layers-per-virtual-pipeline-stage) or --schedules-method dualpipev: plain 1F1B has no second "
           "micro-batch to overlap with" if pp > 1 and not interleaved and args.schedules_method != "dualpipev"
           else "")
    kind = _dispatcher(args)
    yield (f"needs --moe-token-dispatcher-type alltoall (got {kind}: the allgather dispatcher has no all-to-all "
           "to overlap, flex needs DeepEP)" if kind != "alltoall" else "")
    # --recompute-granularity full: each layer's compute nodes recompute in their backward (fb_overlap_recompute.py)
    yield ("does not combine with --moe-shared-expert-overlap (the schedule overlaps the shared experts itself): "
           "drop it" if args.moe_shared_expert_overlap else "")
    # (--moe-permutation-async-comm is off under the overlap, with one line: features.py)
    yield ("does not combine with --moe-alltoall-overlap-comm (both wrap the MoE layer's all-to-alls): drop one"
           if args.moe_alltoall_overlap_comm else "")
    mtp = args.mtp_num_layers or 0
    yield ("runs with at most one MTP layer, and that one only at --pipeline-model-parallel-size > 1 "
           "(Megatron-Core's combined 1F1B)" if mtp > 1 or (mtp == 1 and pp == 1) else "")
    yield ("supports dropless MoE only: drop --moe-expert-capacity-factor"
           if args.moe_expert_capacity_factor is not None else "")
