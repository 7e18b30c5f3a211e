"""--recompute-in-bubble / --recompute-in-advance on Megatron-Core's 1F1B schedule at pipeline size
2: the losses of 20 steps are those of the plain run bit for bit; the schedule's own record shows
each micro-batch's recomputation on the first stage done before its gradient arrived (in the bubble),
not after; in-bubble checkpoints the first stage's layers (fewer bytes held) and leaves the last
stage's alone; bad combinations are refused in one line."""
import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan
from tests_extend.distributed.harness import run_distributed
from tests_extend.unit import recompute_in_bubble_workers as workers


@pytest.fixture(scope="module")
def stages():
    return run_distributed(workers.all_reports, world_size=2, timeout=600)


def test_losses_over_20_steps_are_bitwise_those_of_the_plain_run(stages):
    last = stages[1]
    plain = last["plain"]["losses"]
    assert len(plain) == workers.STEPS and plain[-1] != plain[0]                 # it trains
    for name in ("bubble", "full", "advance"):
        assert last[name]["losses"] == plain, name                              # exact float equality


def _positions(record, event):
    return {mb: i for i, (e, mb) in enumerate(record) if e == event}


@pytest.mark.parametrize("name", ["bubble", "advance"])
def test_first_stage_recomputes_each_micro_batch_before_its_gradient_arrives(stages, name):
    record = stages[0][name]["record"]
    rebuilt, arrived, backward = (_positions(record, e) for e in "RGB")
    assert len(backward) == workers.STEPS * workers.MICROBATCHES
    assert sorted(e for e, _ in record if e == "R") == ["R"] * len(backward)   # once each
    for mb, b in backward.items():
        assert rebuilt[mb] < arrived[mb] < b, (mb, record[max(0, b - 6):b + 1])


def test_last_stage_has_no_bubble_before_its_backward(stages):
    bubble, advance = stages[1]["bubble"]["record"], stages[1]["advance"]["record"]
    assert not [e for e, _ in bubble if e in "RG"]                # in-bubble: the last stage keeps its activations
    for i, (event, mb) in enumerate(advance):                     # in-advance: Megatron's recompute, in backward
        if event == "R":
            assert advance[i + 1] == ("B", mb)


def test_in_bubble_holds_only_the_first_stage_layers_inputs(stages):
    first, last = stages
    assert first["bubble"]["saved"] == first["full"]["saved"] < first["plain"]["saved"] / 4
    assert last["bubble"]["saved"] == last["plain"]["saved"]
    assert first["plain"]["record"] is None


@pytest.mark.parametrize("argv, message", [
    (["--recompute-in-bubble", "--recompute-in-advance", "--pipeline-model-parallel-size", "2", "--num-layers", "4"],
     "--recompute-in-bubble with --recompute-in-advance"),
    (["--recompute-in-advance", "--pipeline-model-parallel-size", "2", "--num-layers", "4"],
     "--recompute-in-advance needs --recompute-granularity full --recompute-method block"),
    (["--recompute-in-bubble", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
      "--recompute-granularity", "selective"], "--recompute-in-bubble with --recompute-granularity selective"),
    (["--recompute-in-bubble", "--pipeline-model-parallel-size", "2", "--num-layers", "8",
      "--num-layers-per-virtual-pipeline-stage", "2"], "only the 1F1B schedule"),
])
def test_bad_combinations_are_refused_in_one_line(argv, message):
    with pytest.raises(MindSpeedConfigError, match=message) as err:
        plan(argv)
    assert "\n" not in str(err.value)


def test_mindspore_refusal_names_what_its_trainer_lacks():
    from mindspeed.backends.base import Level
    from mindspeed.features.registry import get_feature
    from mindspeed.support_matrix import feature_level
    level, limits = feature_level(get_feature("recompute-in-bubble"), "mindspore", "cpu")
    assert level is Level.ABSENT and any("point-to-point receive" in lim for lim in limits), limits
    level, limits = feature_level(get_feature("adaptive-recompute"), "mindspore", "cpu")
    assert level is Level.ABSENT and any("per-layer profile" in lim for lim in limits), limits
