"""MoE communication features (MindSpeed's flag names; rules after MindSpeed upstream's checks):

* --moe-tp-extend-ep: experts sharded over TP x EP ranks, whole experts per rank (tp_extend_ep.py)
* --moe-permutation-async-comm: the dispatcher's collectives started asynchronously, the
  permutation bookkeeping computed while the tokens travel (permutation_async.py)
* --moe-alltoall-overlap-comm: alltoall dispatch and combine in chunks, each chunk's all-to-all
  overlapped with the previous chunk's expert compute (alltoall_overlap.py)
* --moe-allgather-overlap-comm: the allgather dispatcher's gathers and reduce-scatter per local
  expert, each overlapped with another expert's compute (allgather_overlap.py; torch only)

Megatron-Core's MoE layer on the torch backend. The MindSpore trainer's MoE layer
(training/mindspore/moe.py) runs them too: --moe-tp-extend-ep as it is (its expert-parallel group
is the TP x EP block, training/mindspore/parallel.py), the other two without overlap (`emulated`):
MindSpore's CPU collectives have no all-to-all (the backend builds it from AllReduce), so the
chunks and the asynchronous start keep Megatron's order and results, not its overlap.
"""
from __future__ import annotations

import importlib

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, switch
from mindspeed.features.host_flags import NUM_EXPERTS, until_given
from mindspeed.features.registry import register
from mindspeed.versions import megatron_version


def _tp(args) -> int:
    return args.tensor_model_parallel_size or 1


def _ep(args) -> int:
    return args.expert_model_parallel_size or 1


def expert_parallel(args) -> int:
    """Ranks the experts are spread over: EP, times TP with --moe-tp-extend-ep."""
    return _ep(args) * _tp(args) if args.moe_tp_extend_ep else _ep(args)


def missing_megatron_hook(hooks) -> str | None:
    """The first `Class.method` of `hooks` ((module, class, methods), ...) the importable Megatron-Core
    lacks, e.g. core_v0.12's MoE layer, which predates the dispatch/combine steps these features
    wrap; None where all are there (or Megatron-Core is absent: the matrix refuses that itself)."""
    for module, cls, methods in hooks:
        try:
            owner = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            return None
        for method in methods:
            if not hasattr(owner, method):
                return f"{cls}.{method}"
    return None


def _dispatcher(args):
    kind = args.moe_token_dispatcher_type
    return "alltoall" if kind == "alltoall_seq" else kind     # Megatron 0.12's name: alltoall runs it here


class _MoeComm(Feature):
    category = "moe"
    optimization_level = 2
    requires = (Cap.MOE,)
    depends = ("moe",)
    example_world = 2

    megatron_hooks = ()        # ((module, class, methods), ...) that install wraps

    def _megatron_has_hooks(self, args) -> None:
        if args.backend == "mindspore":      # the trainer's own MoE layer, not Megatron's
            return
        missing = missing_megatron_hook(self.megatron_hooks)
        if missing:
            raise FeatureConfigError(f"{self.flags[0].name} wraps Megatron-Core's {missing}, which Megatron-Core "
                                     f"{megatron_version()} lacks (its MoE layer predates the dispatch/combine "
                                     "steps): use Megatron-LM core_v0.16.1, or drop the flag")

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            self.megatron_hook().install(ctx.patcher, ctx.backend)

    @staticmethod
    def megatron_hook():
        """The module whose install(patcher, backend) patches Megatron-Core's MoE layer (its collectives
        the run's backend's); imported only here,
        on the torch backend (it imports Megatron-Core)."""
        raise NotImplementedError

    def _common(self, args) -> None:
        self._megatron_has_hooks(args)
        name = self.flags[0].name
        if args.moe_expert_capacity_factor is not None:
            raise FeatureConfigError(f"{name} supports dropless MoE only: drop --moe-expert-capacity-factor")
        tp = _tp(args)
        if tp > 1 and not args.sequence_parallel:
            raise FeatureConfigError(f"{name} at --tensor-model-parallel-size {tp} needs --sequence-parallel "
                                     "(Megatron-Core's MoE layer trains with TP only under sequence parallelism)")


@register
class MoeTpExtendEp(_MoeComm):
    id = "moe-tp-extend-ep"
    description = "MoE experts sharded over TP x EP ranks (whole experts per rank) instead of TP inside each expert"
    flags = (switch("--moe-tp-extend-ep", "spread whole experts over the TP x EP ranks instead of splitting "
                                          "each expert's weights over TP"),)
    alternatives = "leave it off: each expert's weights are split over the tensor-parallel ranks"
    example = ("--moe-tp-extend-ep", "--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel")

    inert_example = ("--moe-tp-extend-ep", "--num-experts", "4")
    # the MindSpore trainer's process groups and MoE checks read it (and refuse it beside CP or PP)
    inert_host_flags = {"moe_tp_extend_ep": False}

    def inert(self, args) -> str:
        if _tp(args) < 2:
            return "at --tensor-model-parallel-size 1 the experts are whole on each rank already"
        return ""

    def validate(self, args) -> None:
        self._common(args)
        tp, ep = _tp(args), _ep(args)
        experts = until_given(args, NUM_EXPERTS)
        if experts and experts % (tp * ep):
            raise FeatureConfigError(f"--moe-tp-extend-ep needs --num-experts ({experts}) divisible by "
                                     f"tensor x expert parallel size ({tp} x {ep})")
        if args.expert_tensor_parallel_size not in (None, tp):
            raise FeatureConfigError("--moe-tp-extend-ep sets the expert tensor-parallel size itself: "
                                     "drop --expert-tensor-parallel-size")
        if args.moe_shared_expert_overlap:
            raise FeatureConfigError("--moe-tp-extend-ep does not combine with --moe-shared-expert-overlap "
                                     "(as upstream); drop one")
        if _dispatcher(args) not in ("alltoall", "allgather"):
            raise FeatureConfigError("--moe-tp-extend-ep needs --moe-token-dispatcher-type alltoall or allgather")


    @staticmethod
    def megatron_hook():
        from mindspeed.features.moe import tp_extend_ep
        return tp_extend_ep


@register
class MoePermutationAsyncComm(_MoeComm):
    id = "moe-permutation-async-comm"
    description = ("MoE dispatcher collectives started asynchronously; the permutation bookkeeping is "
                   "computed while the tokens travel")
    flags = (switch("--moe-permutation-async-comm", "start the MoE dispatcher's collectives asynchronously "
                                                    "and overlap them with the permutation"),)
    requires = (Cap.MOE, Cap.ASYNC_COMM)
    alternatives = "leave it off: Megatron's dispatcher communicates synchronously"
    example = ("--moe-permutation-async-comm", "--num-experts", "4", "--moe-token-dispatcher-type", "allgather",
               "--expert-model-parallel-size", "2")
    # the MindSpore trainer's MoE layer dispatches by all-to-all only
    examples = {"mindspore": ("--moe-permutation-async-comm", "--num-experts", "4", "--expert-model-parallel-size", "2")}

    inert_example = ("--moe-permutation-async-comm", "--num-experts", "4")
    inert_host_flags = {"moe_permutation_async_comm": False}

    def inert(self, args) -> str:
        kind = _dispatcher(args)
        if kind == "alltoall" and expert_parallel(args) < 2:
            return "at expert parallel size 1 the alltoall dispatcher sends no tokens to another rank"
        if kind == "alltoall" and (args.moe_fb_overlap or args.overlap_moe_expert_parallel_comm):
            # upstream accepts the pair in its DeepSeek-V3 recipe: its overlap layers replace the dispatcher's
            return ("with --moe-fb-overlap the dispatch and combine all-to-alls run as nodes of Megatron-Core's "
                    "combined step, under another micro-batch's compute")
        tp, ep = _tp(args), _ep(args)
        if tp * ep < 2:
            return f"at tensor x expert parallel size 1 the {kind} dispatcher does not communicate"
        return ""

    def validate(self, args) -> None:
        self._common(args)
        kind = _dispatcher(args)
        if kind not in ("alltoall", "allgather"):
            raise FeatureConfigError("--moe-permutation-async-comm needs --moe-token-dispatcher-type allgather "
                                     "or alltoall")
        if kind == "alltoall" and _tp(args) > 1 and not args.moe_tp_extend_ep:
            raise FeatureConfigError("--moe-permutation-async-comm with the alltoall dispatcher at TP > 1 needs "
                                     "--moe-tp-extend-ep (the expert-TP gather stays synchronous)")


    @staticmethod
    def megatron_hook():
        from mindspeed.features.moe import permutation_async
        return permutation_async
    megatron_hooks = (("megatron.core.transformer.moe.token_dispatcher", "MoEAllGatherTokenDispatcher",
                       ("token_dispatch", "dispatch_postprocess")),
                      ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher",
                       ("token_dispatch",)))


@register
class MoeAlltoallOverlapComm(_MoeComm):
    id = "moe-alltoall-overlap-comm"
    description = ("MoE alltoall dispatch/combine in chunks, each chunk's all-to-all overlapped with "
                   "expert compute (and the shared experts' first GEMM)")
    flags = (switch("--moe-alltoall-overlap-comm", "overlap the MoE alltoall dispatch and combine with the "
                                                   "experts' compute"),)
    requires = (Cap.MOE, Cap.ASYNC_COMM, Cap.ALL_TO_ALL)
    alternatives = "leave it off: Megatron's alltoall dispatcher communicates before and after the experts"
    example = ("--moe-alltoall-overlap-comm", "--num-experts", "4", "--expert-model-parallel-size", "2")

    inert_example = ("--moe-alltoall-overlap-comm", "--num-experts", "4")
    inert_host_flags = {"moe_alltoall_overlap_comm": False}

    def inert(self, args) -> str:
        if _dispatcher(args) == "alltoall" and expert_parallel(args) < 2:
            return "at expert parallel size 1 the alltoall dispatcher has no all-to-all to overlap"
        return ""

    def validate(self, args) -> None:
        self._common(args)
        if _dispatcher(args) != "alltoall":
            raise FeatureConfigError("--moe-alltoall-overlap-comm needs --moe-token-dispatcher-type alltoall")
        if _tp(args) > 1 and not args.moe_tp_extend_ep:
            raise FeatureConfigError("--moe-alltoall-overlap-comm at TP > 1 needs --moe-tp-extend-ep (as upstream)")


    @staticmethod
    def megatron_hook():
        from mindspeed.features.moe import alltoall_overlap
        return alltoall_overlap
    megatron_hooks = (("megatron.core.transformer.moe.moe_layer", "MoELayer",
                       ("dispatch", "routed_experts_compute", "combine")),)


@register
class MoeAllgatherOverlapComm(_MoeComm):
    id = "moe-allgather-overlap-comm"
    description = ("MoE allgather dispatcher's all-gather and reduce-scatter per local expert, each "
                   "overlapped with another expert's compute")
    flags = (switch("--moe-allgather-overlap-comm", "overlap the MoE allgather dispatcher's all-gather and "
                                                    "reduce-scatter with the experts' compute"),)
    requires = (Cap.MOE, Cap.ASYNC_COMM, Cap.ALL_GATHER, Cap.REDUCE_SCATTER)
    backends = ("torch",)
    unsupported = {"mindspore": "the MindSpore trainer's MoE layer gathers every token for all its experts in one "
                                "collective and its CPU sub-group all-gather and reduce-scatter are AllReduce "
                                "emulations (no per-expert pipeline to overlap); drop the flag there"}
    alternatives = "leave it off: Megatron's allgather dispatcher communicates before and after the experts"
    example = ("--moe-allgather-overlap-comm", "--moe-token-dispatcher-type", "allgather", "--num-experts", "4",
               "--expert-model-parallel-size", "2")

    inert_example = ("--moe-allgather-overlap-comm", "--num-experts", "4")
    inert_host_flags = {"moe_allgather_overlap_comm": False}

    def inert(self, args) -> str:
        if _tp(args) * _ep(args) < 2:       # whichever dispatcher: none communicates there
            return "at tensor x expert parallel size 1 the MoE dispatcher gathers nothing"
        experts = until_given(args, NUM_EXPERTS)
        if experts and _tp(args) == 1 and experts == _ep(args):
            return "with one expert per rank there is one chunk: nothing runs while it travels"
        return ""

    def validate(self, args) -> None:
        self._common(args)
        if _dispatcher(args) != "allgather":
            raise FeatureConfigError("--moe-allgather-overlap-comm needs --moe-token-dispatcher-type allgather "
                                     "(for alltoall: --moe-alltoall-overlap-comm)")
        if _tp(args) > 1:
            raise FeatureConfigError("--moe-allgather-overlap-comm runs at --tensor-model-parallel-size 1 only "
                                     "(the per-expert chunks are not built for tensor-parallel experts): "
                                     "use TP 1 with --expert-model-parallel-size, or drop the flag")

    @staticmethod
    def megatron_hook():
        from mindspeed.features.moe import allgather_overlap
        return allgather_overlap
    megatron_hooks = (("megatron.core.transformer.moe.moe_layer", "MoELayer",
                       ("dispatch", "routed_experts_compute", "combine")),)
