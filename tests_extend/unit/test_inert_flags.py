"""A flag that has no effect in the layout (as Megatron says of --sequence-parallel at TP 1) is
accepted with one line saying so, never silently and never refused (Feature.inert): for every
feature that can be inert, its `inert_example` on both backends is accepted by `check` with one
note naming its flags, the plan applies nothing of it, and what the rest of the run sees is what
it would see without the flags. What cannot be honoured in any layout stays refused.
(Real runs of both trainers: tests_extend/system/test_matrix_walk.py's inert cells.)"""
import contextlib
import io

import pytest

from mindspeed.__main__ import main as mindspeed_main
from mindspeed.adaptor_core import MindSpeedConfigError, plan
from mindspeed.features.base import Feature
from mindspeed.features.registry import all_features
from tests_extend.system.matrix_walk import without_flags

BACKENDS = ("torch", "mindspore")
# features whose inert() no command line reaches, and why
NEVER_INERT = {"ulysses-cp-algo": "the default algorithm: at CP 1 no flag of its own turns it on "
                                  "(the CP flags given go to ring's or hybrid's feature)"}


def _inert_argv(feature) -> tuple:
    """Its inert_example, or for a flag that never has an effect here, its example."""
    return feature.inert_example or feature.example


def _plan(argv):
    return plan(list(argv), unknown_flags="trainer")      # as `check` plans: the built-in trainers' flags


def _inert_in(feature, argv) -> bool:
    try:
        return feature.id in {f.id for f, *_ in _plan(argv).inert}
    except MindSpeedConfigError:
        return False


OVERRIDING = [f for f in all_features() if type(f).inert is not Feature.inert]
INERT = [f for f in OVERRIDING if _inert_in(f, _inert_argv(f))]


def _check(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = mindspeed_main(["check", *argv])
    return rc, out.getvalue(), err.getvalue()


def test_every_feature_that_can_be_inert_has_an_example():
    assert {f.id for f in INERT} == {f.id for f in OVERRIDING} - set(NEVER_INERT), \
        "a feature with an inert() needs an inert_example where it is inert (or a NEVER_INERT entry saying why)"
    assert {"sequence-parallel", "megatron-cp-algo", "hybrid-cp-algo", "general-attention-mask", "ascend-coc",
            "moe-tp-extend-ep", "moe-permutation-async-comm", "moe-alltoall-overlap-comm"} <= {f.id for f in INERT}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", INERT, ids=[f.id for f in INERT])
def test_an_inert_flag_is_accepted_with_one_line_naming_it(feature, backend):
    argv = [*_inert_argv(feature), "--backend", backend]
    if backend != "torch" and _check(without_flags(feature, argv))[0] != 0:
        pytest.skip(f"the rest of {feature.id}'s command line is refused on {backend}")
    rc, out, err = _check(argv)
    assert rc == 0, err
    notes = [line for line in out.splitlines() if "has no effect here" in line]
    assert len(notes) == 1, out
    typed, why = notes[0][len("MindSpeed: "):].split(" has no effect here: ")
    assert why and "\n" not in why
    own = [tok for tok in argv if tok in {fl.name for fl in feature.flags}]
    assert own and typed.startswith(own[0]), notes[0]
    assert all(tok in typed for tok in own), notes[0]       # every flag of its own given is named
    p = _plan(argv)
    assert p.notes() == notes
    assert [f.id for f, *_ in p.inert] == [feature.id]
    assert feature.id not in {f.id for f in p.features + p.dropped}
    # the rest of the plan, and what the host is given, is as without the flags: its own flags are
    # the values of a run without them (inert_host_flags) or left as typed, nothing else differs
    base = _plan(without_flags(feature, argv))
    assert [f.id for f in p.features] == [f.id for f in base.features]
    own_dests = {fl.dest for fl in feature.flags} - set(feature.inert_host_flags)
    assert {k: v for k, v in vars(p.args).items() if k not in own_dests} == \
           {k: v for k, v in vars(base.args).items() if k not in own_dests}


def test_the_host_namespace_gets_the_values_of_a_run_without_them():
    import argparse
    from mindspeed.adaptor_core import set_host_flags
    host = argparse.Namespace(tensor_model_parallel_size=1, sequence_parallel=True, use_ascend_coc=True,
                              coc_parallel_num=2, num_experts=4, moe_tp_extend_ep=True)
    p = plan(host)
    set_host_flags(p, host)
    assert not host.sequence_parallel and not host.use_ascend_coc and not host.moe_tp_extend_ep
    assert host.coc_parallel_num == 1
    assert sorted(f.id for f, *_ in p.inert) == ["ascend-coc", "moe-tp-extend-ep", "sequence-parallel"]


def test_each_inert_feature_gets_its_own_line():
    # every example at once (hybrid's and kvallgather's CP flags would go to the same CP feature as
    # ring's: one --context-parallel-algo; FSDP2's sets TP 2, the layout where the walk's 2 processes
    # leave it no data parallelism, which gives the MoE overlaps work; tp-2d's sizes alone still meet
    # DualPipeV's and CoC's conflicts); --num-experts given several times is fine
    apart = ("hybrid-cp-algo", "kvallgather-cp-algo", "torch-fsdp2", "tp-2d")
    mine = [f for f in INERT if f.inert_example and f.id not in apart]
    argv = [tok for f in mine for tok in f.inert_example]
    p = plan(argv)
    assert sorted(f.id for f, *_ in p.inert) == sorted(f.id for f in mine)
    assert len(p.notes()) == len(p.inert) and all(n.count("has no effect here") == 1 for n in p.notes())


@pytest.mark.parametrize("argv, note", [
    # at CP 1 every CP flag given is taken by one algorithm's feature, whichever flags they are
    (["--use-cp-send-recv-overlap"], "MindSpeed: --use-cp-send-recv-overlap has no effect here: "
                                     "at --context-parallel-size 1 there is no sequence to split"),
    (["--cp-window-size", "2"], "MindSpeed: --cp-window-size 2 has no effect here"),
    (["--ulysses-degree-in-cp", "2"], "MindSpeed: --ulysses-degree-in-cp 2 has no effect here"),
    (["--context-parallel-algo", "megatron_cp_algo", "--ulysses-degree-in-cp", "2"],
     "MindSpeed: --context-parallel-algo megatron_cp_algo (with --ulysses-degree-in-cp 2) has no effect here"),
    (["--use-ascend-coc"], "MindSpeed: --use-ascend-coc has no effect here: at --coc-mode 0, or the default -1"),
    (["--use-ascend-coc", "--coc-mode", "0", "--coc-parallel-num", "2", "--tensor-model-parallel-size", "2"],
     "MindSpeed: --use-ascend-coc (with --coc-mode 0, --coc-parallel-num 2) has no effect here"),
    (["--moe-permutation-async-comm", "--moe-token-dispatcher-type", "allgather", "--num-experts", "4"],
     "MindSpeed: --moe-permutation-async-comm has no effect here: at tensor x expert parallel size 1"),
    (["--moe-alltoall-overlap-comm", "--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     "MindSpeed: --moe-alltoall-overlap-comm has no effect here: at expert parallel size 1"),
])
def test_more_layouts_where_a_flag_does_nothing(argv, note):
    p = plan(argv)
    assert len(p.notes()) == 1 and p.notes()[0].startswith(note), p.notes()


@pytest.mark.parametrize("argv, message", [
    # a value wrong in any layout is refused in every layout, also where the feature would do nothing
    (["--use-ascend-coc", "--coc-parallel-num", "3"], "--coc-parallel-num must be 1, 2, 4 or 8, got 3"),
    (["--use-ascend-coc", "--coc-mode", "2"], "--coc-mode 2 needs --coc-parallel-num 2, 4 or 8"),
    (["--use-ascend-coc", "--coc-fused-kernel"], "--coc-fused-kernel: no fused matmul+collective kernel"),
    (["--cp-window-size", "-2"], "--cp-window-size must be >= 1, got -2"),
    (["--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "0"],
     "--ulysses-degree-in-cp must be >= 1, got 0"),
    # a combination that cannot be honoured where the feature acts stays refused
    (["--context-parallel-size", "2", "--use-cp-send-recv-overlap"], "applies to ring attention"),
    (["--moe-alltoall-overlap-comm", "--moe-token-dispatcher-type", "allgather", "--num-experts", "4"],
     "--moe-alltoall-overlap-comm needs --moe-token-dispatcher-type alltoall"),
    (["--moe-tp-extend-ep"], "needs --num-experts (moe) to be on too"),
    # a sub-flag whose feature is off is not inert: the feature is not on at all
    (["--context-parallel-size", "2", "--ulysses-degree-in-cp", "2"], "--ulysses-degree-in-cp has no effect without"),
])
def test_what_cannot_be_honoured_stays_refused(argv, message):
    with pytest.raises(MindSpeedConfigError) as err:
        plan(argv)
    assert message in str(err.value) and "\n" not in str(err.value)
