"""Context-parallel features: flags, requirements, validation and the host-model hooks.

One feature per algorithm (so the support matrix shows what each needs); they share the CP
flags. `--context-parallel-size` is Megatron's own flag.
"""
from __future__ import annotations

import os

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag, switch
from mindspeed.features.context_parallel import attention, sharding
from mindspeed.features.context_parallel.groups import ALGOS, MASK_TYPES, RINGS, check_options
from mindspeed.features.context_parallel.ulysses import kv_repeats
from mindspeed.features.registry import register

# the fused feature whose kernel merges the ring steps (features/fused/features.py)
FUSED_MERGE = "fused-ring-attention-update"

CP_SIZE = Flag("--context-parallel-size", dict(type=int, default=1, help="context-parallel size"), megatron=True)
CP_ALGO = Flag("--context-parallel-algo", dict(choices=list(ALGOS), default="ulysses_cp_algo",
                                               help="how attention is split across CP ranks"))
MASK_TYPE = Flag("--attention-mask-type", dict(choices=list(MASK_TYPES), default="causal",
                                               help="causal (implicit mask) or general (the batch's mask)"))
OVERLAP = switch("--use-cp-send-recv-overlap", "ring CP: send the next K/V block while computing this one")
WINDOW = Flag("--cp-window-size", dict(type=int, default=1,
                                       help="ring CP: inner ring size of the double ring (1 = one ring)"))
ULYSSES_DEGREE = Flag("--ulysses-degree-in-cp", dict(type=int, default=None,
                                                     help="hybrid CP: Ulysses group size inside the CP group"))


def _cp_size(args) -> int:
    return args.context_parallel_size or 1


FLAGS = {"ulysses_cp_algo": (CP_ALGO, CP_SIZE, MASK_TYPE),
         "megatron_cp_algo": (CP_ALGO, CP_SIZE, MASK_TYPE, OVERLAP, WINDOW),
         "hybrid_cp_algo": (CP_ALGO, CP_SIZE, MASK_TYPE, OVERLAP, WINDOW, ULYSSES_DEGREE),
         "kvallgather_cp_algo": (CP_ALGO, CP_SIZE, MASK_TYPE)}
# the CP flags that only an algorithm reads (not --attention-mask-type: general-attention-mask's too)
_ALGO_FLAGS = (CP_ALGO, OVERLAP, WINDOW, ULYSSES_DEGREE)


def _given(fl: Flag, args) -> bool:
    return getattr(args, fl.dest) not in (fl.default, None)


def algo_at_cp1(args) -> str | None:
    """At --context-parallel-size 1, the algorithm whose feature takes the CP flags given (inert: they
    split nothing): the one named if it reads them all, else ring's or hybrid's (which reads every
    one); None when none is given."""
    given = [fl for fl in _ALGO_FLAGS if _given(fl, args)]
    if not given:
        return None
    named = args.context_parallel_algo
    return next(algo for algo in (named, "megatron_cp_algo", "hybrid_cp_algo")
                if all(fl in FLAGS.get(algo, ()) for fl in given))


def _bad_value(args) -> str:
    """What is wrong with the CP flags' own values in any layout ('' if nothing)."""
    window, u = args.cp_window_size, args.ulysses_degree_in_cp
    if (window or 1) < 1:                # 0 reads as 1, as at CP > 1
        return f"{WINDOW.name} must be >= 1, got {window}"
    if u is not None and u < 1:
        return f"{ULYSSES_DEGREE.name} must be >= 1, got {u}"
    return ""


class _ContextParallel(Feature):
    category = "context_parallel"
    optimization_level = 2
    algo = ""

    def enabled(self, args) -> bool:
        size = _cp_size(args)
        if size == 1:      # on only to say that the CP flags given do nothing (inert)
            return algo_at_cp1(args) == self.algo
        return size > 1 and args.context_parallel_algo == self.algo

    def inert(self, args) -> str:
        if _cp_size(args) == 1 and not _bad_value(args):
            return "at --context-parallel-size 1 there is no sequence to split"
        return ""

    # the flags only an algorithm reads: what a run without them has
    inert_host_flags = {fl.dest: fl.default for fl in _ALGO_FLAGS}

    def typed_flags(self, args) -> list[str]:
        # --attention-mask-type is general-attention-mask's to name (it says so itself when inert)
        return [t for t in super().typed_flags(args) if not t.startswith(MASK_TYPE.name + " ")]

    shared_hint = "--context-parallel-size > 1"

    def on_hint(self) -> str:
        return f"--context-parallel-size > 1 (--context-parallel-algo {self.algo})"

    @property
    def example(self) -> tuple:
        extra = ("--ulysses-degree-in-cp", "2") if self.algo == "hybrid_cp_algo" else ()
        return ("--context-parallel-size", "2", "--context-parallel-algo", self.algo) + extra
    example_world = 2

    def validate(self, args) -> None:
        if _cp_size(args) == 1:      # on at CP 1 and not inert: a value wrong in any layout
            raise FeatureConfigError(_bad_value(args))
        size = args.context_parallel_size
        try:
            u = check_options(self.algo, size, args.ulysses_degree_in_cp, args.cp_window_size or 1)
            world = args.world_size or int(os.environ.get("WORLD_SIZE", "0") or 0)
            tp = args.tensor_model_parallel_size or 1
            pp = args.pipeline_model_parallel_size or 1
            if world and world % (size * tp * pp):
                raise ValueError(f"--context-parallel-size {size} x TP {tp} x PP {pp} does not divide the "
                                 f"world size {world}")
            seq = args.seq_length
            if seq:
                sharding.check_seq_len(seq, self.algo, size, u)
            heads = args.num_attention_heads
            if heads and u > 1:
                if heads % tp:
                    raise ValueError(f"{heads} attention heads do not divide by TP {tp}")
                gqa = args.group_query_attention      # None (not said): a --num-query-groups given counts
                groups = args.num_query_groups if gqa or gqa is None else None
                kv_repeats(heads // tp, max((groups or heads) // tp, 1), u)
        except ValueError as exc:
            raise FeatureConfigError(f"{self.flags[0].name} {self.algo}: {exc}") from exc
        if args.use_cp_send_recv_overlap and self.algo not in RINGS:
            raise FeatureConfigError("--use-cp-send-recv-overlap applies to ring attention "
                                     f"(megatron_cp_algo / hybrid_cp_algo), not {self.algo}")

    def apply(self, ctx, args) -> None:
        u = args.ulysses_degree_in_cp
        provider = None
        if ctx.backend_name == "torch":
            from mindspeed.features.context_parallel import megatron_hook  # hook may import Megatron (.importlinter)
            options = megatron_hook.CPOptions(args, ctx.backend, ctx.applies(FUSED_MERGE))
            megatron_hook.install(ctx.patcher, options)
            ctx.provide("megatron_cp_groups", options.groups)    # what the hooks built (id(group) -> CPGroups)
            from megatron.core import parallel_state
            provider = parallel_state.get_context_parallel_group
        ctx.provide("shard_batch", sharding.BatchSharding(ctx.backend, self.algo, u, provider))
        ctx.provide("context_parallel_attention", attention.context_parallel_attention)   # read at apply


@register
class UlyssesContextParallel(_ContextParallel):
    id = "ulysses-cp-algo"
    algo = "ulysses_cp_algo"
    description = "Ulysses context parallelism: all_to_all of sequence and heads around attention"
    flags = FLAGS[algo]
    requires = (Cap.ALL_TO_ALL, Cap.FLASH_ATTENTION)
    alternatives = "use --context-parallel-algo megatron_cp_algo (ring attention needs only send/recv)"


@register
class RingContextParallel(_ContextParallel):
    id = "megatron-cp-algo"
    algo = "megatron_cp_algo"
    description = "ring attention context parallelism (load balanced causal), overlap, double ring"
    flags = FLAGS[algo]
    requires = (Cap.SEND_RECV, Cap.FLASH_ATTENTION, Cap.RING_ATTENTION_UPDATE, Cap.CUSTOM_OP)
    alternatives = "use --context-parallel-algo ulysses_cp_algo"
    inert_example = ("--context-parallel-algo", "megatron_cp_algo", "--use-cp-send-recv-overlap",
                     "--cp-window-size", "2")


@register
class HybridContextParallel(_ContextParallel):
    id = "hybrid-cp-algo"
    algo = "hybrid_cp_algo"
    description = "hybrid context parallelism: Ulysses inside groups of --ulysses-degree-in-cp, ring across"
    flags = FLAGS[algo]
    requires = (Cap.ALL_TO_ALL, Cap.SEND_RECV, Cap.SUBGROUPS, Cap.FLASH_ATTENTION,
                Cap.RING_ATTENTION_UPDATE, Cap.CUSTOM_OP)
    alternatives = "use --context-parallel-algo ulysses_cp_algo or megatron_cp_algo"
    inert_example = ("--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2")


@register
class KVAllGatherContextParallel(_ContextParallel):
    id = "kvallgather-cp-algo"
    algo = "kvallgather_cp_algo"
    description = ("KV all-gather context parallelism (Llama 3): local load-balanced query chunks against "
                   "K/V all-gathered over the CP group")
    flags = FLAGS[algo]
    requires = (Cap.ALL_GATHER, Cap.REDUCE_SCATTER, Cap.FLASH_ATTENTION, Cap.RING_ATTENTION_UPDATE)
    alternatives = "use --context-parallel-algo megatron_cp_algo or ulysses_cp_algo"
    inert_example = ("--context-parallel-algo", "kvallgather_cp_algo")
