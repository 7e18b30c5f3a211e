"""--adaptive-recompute-device-size on Megatron-Core: the plan (a pure function of the profile) and
the run. After the profiled steps the chosen layers recompute through Megatron-Core's checkpoint: the
losses of 20 steps are those of the plain run bit for bit, and the bytes held for backward (the memory
meter, the whole model) drop to what the plan promised, under the budget the plain run exceeds."""
import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan
from mindspeed.features.memory.adaptive_recompute_plan import LayerProfile, choose_layers
from tests_extend.distributed.harness import run_distributed
from tests_extend.unit import adaptive_recompute_workers as workers

MB = 1 << 20


def layers(*held, kept=10, seconds=None):
    return [LayerProfile(i, h, kept, (seconds or [1.0] * len(held))[i]) for i, h in enumerate(held)]


def test_plan_keeps_everything_when_the_budget_allows():
    p = choose_layers(layers(100, 100, 100), budget_bytes=300)
    assert p.recompute == frozenset() and p.held_bytes == 300 and p.fits


def test_plan_recomputes_the_fewest_layers_that_fit():
    # 3 x 100 held, saving 90 each: 300 -> 210 -> 120 <= 150 after two layers, not after one
    p = choose_layers(layers(100, 100, 100), budget_bytes=150)
    assert len(p.recompute) == 2 and p.held_bytes == 120 and p.fits


def test_plan_prefers_the_most_bytes_per_recompute_second():
    # layer 1 saves as much as layer 0 in a tenth of the time; layer 2 saves most but is slow
    p = choose_layers(layers(100, 100, 200, seconds=[1.0, 0.1, 10.0]), budget_bytes=320)
    assert p.recompute == frozenset({1}) and p.held_bytes == 310


def test_plan_gives_back_a_recompute_the_budget_no_longer_needs():
    # greedy by ratio takes 0 (90 B/s) then 2 (190/4 s); 2 alone fits: 0 is given back
    p = choose_layers(layers(100, 50, 200, seconds=[1.0, 1.0, 4.0]), budget_bytes=170)
    assert p.recompute == frozenset({2}) and p.held_bytes == 160


def test_plan_counts_every_micro_batch_in_flight_and_says_when_it_cannot_fit():
    p = choose_layers(layers(100, 100), budget_bytes=300, in_flight=2)      # 400 -> 220: one layer
    assert len(p.recompute) == 1 and p.held_bytes == 220
    p = choose_layers(layers(100, 100), budget_bytes=10, in_flight=2)       # all recompute: 40 > 10
    assert p.recompute == frozenset({0, 1}) and p.held_bytes == 40 and not p.fits


@pytest.fixture(scope="module")
def reports():
    (result,) = run_distributed(workers.all_reports, world_size=1, timeout=600)
    return result


def test_losses_over_20_steps_are_bitwise_those_of_the_plain_run(reports):
    off, adaptive = reports["off"][0], reports["adaptive"][0]
    assert len(off) == workers.STEPS and off[-1] != off[0]            # it trains
    assert adaptive == off                                             # exact float equality


def test_the_plan_fits_a_budget_the_plain_run_exceeds_and_the_meter_agrees(reports):
    _, off_saved, off_plan, _ = reports["off"]
    _, saved, (recompute, held, fits), profiles = reports["adaptive"]
    budget = workers.BUDGET_MB * MB
    plain_layers = sum(p.held_bytes for p in profiles)
    outside = off_saved[-1] - plain_layers           # embedding / loss activations: outside the plan
    assert off_plan is None and plain_layers > budget                  # the plain run exceeds the budget
    assert fits and held <= budget and 0 < len(recompute) < workers.LAYERS, recompute
    # the meter sees the plan, plus the model-wide tensors the checkpoints are handed (the rotary
    # embedding), held once: less than one layer's input
    assert 0 <= saved[-1] - outside - held < profiles[0].checkpoint_bytes, (saved[-1], outside, held)
    assert saved[-1] < off_saved[-1]


def test_no_plan_before_the_profiled_steps_end(reports):
    assert reports["still_profiling"][2] is None and reports["still_profiling"][0] == reports["off"][0][:3]


@pytest.mark.parametrize("argv, message", [
    (["--adaptive-recompute-device-size", "8", "--adaptive-recompute-profiling-step", "0"],
     "--adaptive-recompute-profiling-step must be >= 1, got 0"),
    (["--adaptive-recompute-device-size", "8", "--recompute-granularity", "full", "--recompute-method", "block"],
     "--adaptive-recompute-device-size with --recompute-granularity full"),
    (["--adaptive-recompute-profiling-step", "3"], "--adaptive-recompute-profiling-step has no effect without"),
    (["--adaptive-recompute-device-swap"], "legacy"),
])
def test_bad_values_are_refused_in_one_line(argv, message):
    with pytest.raises(MindSpeedConfigError, match=message) as err:
        plan(argv)
    assert "\n" not in str(err.value)
