"""--moe-tp-extend-ep, --moe-alltoall-overlap-comm, --moe-allgather-overlap-comm,
--moe-permutation-async-comm: every combination
they cannot honour is refused in one line before any work (rules after MindSpeed upstream's), the
good ones plan, and where the layout leaves them nothing to do (TP 1, EP 1) they are accepted with
one line saying so. (The computations: tests_extend/distributed/test_moe_comm.py.)"""
import re

import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan

MOE = ["--num-experts", "4"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EP2 = ["--expert-model-parallel-size", "2"]
AG_OVERLAP = ["--moe-allgather-overlap-comm", "--moe-token-dispatcher-type", "allgather"]


@pytest.mark.parametrize("argv, message", [
    (["--moe-tp-extend-ep", "--num-experts", "6"] + TP2 + EP2,
     "--num-experts (6) divisible by tensor x expert parallel size (2 x 2)"),
    (["--moe-tp-extend-ep"] + TP2, "needs --num-experts (moe) to be on too"),
    (["--moe-tp-extend-ep", "--tensor-model-parallel-size", "2"] + MOE, "needs --sequence-parallel"),
    (["--moe-tp-extend-ep", "--moe-shared-expert-intermediate-size", "8", "--moe-shared-expert-overlap"] + MOE + TP2,
     "does not combine with --moe-shared-expert-overlap"),
    (["--moe-alltoall-overlap-comm", "--moe-token-dispatcher-type", "allgather"] + MOE + EP2,
     "--moe-alltoall-overlap-comm needs --moe-token-dispatcher-type alltoall"),
    (["--moe-alltoall-overlap-comm", "--num-experts", "4"] + TP2 + EP2, "at TP > 1 needs --moe-tp-extend-ep"),
    (["--moe-permutation-async-comm"] + MOE + TP2 + EP2, "at TP > 1 needs --moe-tp-extend-ep"),
    (["--moe-allgather-overlap-comm"] + MOE + EP2, "--moe-allgather-overlap-comm needs --moe-token-dispatcher-type "
                                                   "allgather (for alltoall: --moe-alltoall-overlap-comm)"),
    (AG_OVERLAP + MOE + TP2 + EP2, "runs at --tensor-model-parallel-size 1 only"),
    (["--backend", "mindspore"] + AG_OVERLAP + MOE + EP2,
     "CPU sub-group all-gather and reduce-scatter are AllReduce"),
    # the MindSpore trainer's MoE layer: experts split over TP (no --moe-tp-extend-ep) at EP = PP = 1, with
    # sequence parallelism, without shared experts; whole experts over TP without TP-split shared experts
    (["--backend", "mindspore"] + MOE + TP2 + EP2, "splits every expert over the tensor-parallel ranks at"),
    (["--backend", "mindspore", "--tensor-model-parallel-size", "2"] + MOE, "needs --sequence-parallel at tensor"),
    (["--backend", "mindspore", "--moe-shared-expert-intermediate-size", "8"] + MOE + TP2,
     "drop --moe-shared-expert-intermediate-size and --moe-token-dispatcher-type allgather"),
    (["--backend", "mindspore", "--moe-tp-extend-ep", "--moe-shared-expert-intermediate-size", "8"] + MOE + TP2,
     "splits no shared experts over the tensor-parallel ranks"),
    (["--backend", "mindspore", "--moe-tp-extend-ep", "--context-parallel-size", "2"] + MOE + TP2,
     "runs at context parallel size 1"),
])
def test_combinations_they_cannot_honour_are_refused(argv, message):
    with pytest.raises(MindSpeedConfigError, match="MindSpeed: .*" + re.escape(message)) as info:
        plan(argv)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("argv, expected", [
    (["--moe-tp-extend-ep"] + MOE + TP2, {"moe-tp-extend-ep"}),
    (AG_OVERLAP + MOE + EP2, {"moe-allgather-overlap-comm"}),
    (["--moe-alltoall-overlap-comm", "--moe-permutation-async-comm"] + MOE + EP2,
     {"moe-alltoall-overlap-comm", "moe-permutation-async-comm"}),
    (["--moe-tp-extend-ep", "--moe-alltoall-overlap-comm"] + MOE + TP2,
     {"moe-tp-extend-ep", "moe-alltoall-overlap-comm"}),
    (["--moe-permutation-async-comm", "--moe-token-dispatcher-type", "allgather"] + MOE + TP2,
     {"moe-permutation-async-comm"}),
    # the MindSpore trainer's MoE layer: every expert split over TP (Megatron-Core's expert TP = TP, moe.py)
    (["--backend", "mindspore"] + MOE + TP2, {"moe"}),
    # whole experts over TP x EP (training/mindspore/parallel.py)
    (["--backend", "mindspore", "--moe-tp-extend-ep"] + MOE + TP2, {"moe-tp-extend-ep"}),
    # its distributed optimizer shards the experts' state over expert-DP (training/mindspore/distrib_optimizer.py)
    (["--backend", "mindspore", "--moe-tp-extend-ep", "--use-distributed-optimizer"] + MOE + TP2, {"moe-tp-extend-ep"}),
    (["--backend", "mindspore", "--use-distributed-optimizer"] + MOE + EP2, {"moe"}),
    (["--backend", "mindspore", "--moe-tp-extend-ep", "--moe-alltoall-overlap-comm", "--moe-permutation-async-comm"]
     + MOE + TP2 + EP2, {"moe-tp-extend-ep", "moe-alltoall-overlap-comm", "moe-permutation-async-comm"}),
    # the MindSpore trainer's MoE layer runs them without overlap (training/mindspore/moe.py)
    (["--backend", "mindspore", "--moe-alltoall-overlap-comm", "--moe-permutation-async-comm",
      "--moe-shared-expert-intermediate-size", "8", "--moe-shared-expert-overlap"] + MOE + EP2,
     {"moe-alltoall-overlap-comm", "moe-permutation-async-comm", "moe-shared-expert-overlap"}),
])
def test_good_combinations_plan(argv, expected):
    ids = {f.id for f in plan(argv).features}
    assert expected <= ids


@pytest.mark.parametrize("argv, inert, why", [
    (["--moe-tp-extend-ep"] + MOE, "moe-tp-extend-ep", "the experts are whole on each rank already"),
    # with what it would refuse at TP > 1: moot where the flag does nothing
    (["--moe-tp-extend-ep", "--moe-shared-expert-intermediate-size", "8", "--moe-shared-expert-overlap"] + MOE,
     "moe-tp-extend-ep", "the experts are whole on each rank already"),
    (["--moe-alltoall-overlap-comm"] + MOE, "moe-alltoall-overlap-comm", "no all-to-all to overlap"),
    (["--moe-alltoall-overlap-comm", "--tensor-model-parallel-size", "2", "--sequence-parallel"] + MOE,
     "moe-alltoall-overlap-comm", "no all-to-all to overlap"),
    (["--moe-permutation-async-comm"] + MOE, "moe-permutation-async-comm", "sends no tokens to another rank"),
    (["--moe-permutation-async-comm", "--moe-token-dispatcher-type", "allgather"] + MOE,
     "moe-permutation-async-comm", "the allgather dispatcher does not communicate"),
    (AG_OVERLAP + MOE, "moe-allgather-overlap-comm", "the MoE dispatcher gathers nothing"),
    (["--moe-allgather-overlap-comm"] + MOE, "moe-allgather-overlap-comm", "the MoE dispatcher gathers nothing"),
    (AG_OVERLAP + ["--num-experts", "2"] + EP2,
     "moe-allgather-overlap-comm", "with one expert per rank there is one chunk"),
    # with the MindSpore trainer's distributed optimizer too
    (["--backend", "mindspore", "--moe-tp-extend-ep", "--use-distributed-optimizer"] + MOE,
     "moe-tp-extend-ep", "the experts are whole on each rank already"),
])
def test_where_the_layout_leaves_them_nothing_to_do_they_are_noted(argv, inert, why):
    p = plan(argv)
    assert [f.id for f, *_ in p.inert] == [inert] and inert not in {f.id for f in p.features}
    assert len(p.notes()) == 1 and why in p.notes()[0]
    assert not getattr(p.args, inert.replace("-", "_"))      # the rest of the run sees it off


def test_the_gate_finds_the_megatron_core_methods_the_features_wrap():
    """The installed Megatron-Core has every method the features wrap; a method it lacks is named
    (Megatron-LM core_v0.12.1's refusal itself: test_megatron_lm.py's describe test)."""
    from mindspeed.features.moe.features import (MoeAllgatherOverlapComm, MoeAlltoallOverlapComm,
                                                 MoePermutationAsyncComm, missing_megatron_hook)
    for feature in (MoeAlltoallOverlapComm, MoeAllgatherOverlapComm, MoePermutationAsyncComm):
        assert feature.megatron_hooks and missing_megatron_hook(feature.megatron_hooks) is None
    module, cls, methods = MoeAlltoallOverlapComm.megatron_hooks[0]
    assert missing_megatron_hook(((module, cls, (*methods, "token_permutation_v2")),)) == f"{cls}.token_permutation_v2"
