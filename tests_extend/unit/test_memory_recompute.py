"""--recompute-activation-function / --recompute-norm on Megatron-Core: the same losses bit for
bit, fewer bytes held for backward (so a recompute that silently does nothing fails), the
--...-num-layers limit honoured, bad values refused before work."""
import argparse

import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan
from tests_extend.distributed.harness import run_distributed
from tests_extend.unit import recompute_workers


@pytest.fixture(scope="module")
def reports():
    (result,) = run_distributed(recompute_workers.all_reports, world_size=1, timeout=600)
    print({name: f"{r[2]:.1f}s" for name, r in result.items()})
    return result


def test_losses_are_bitwise_identical_with_and_without_recompute(reports):
    losses = {name: r[0] for name, r in reports.items()}
    off = losses["off"]
    assert len(off) == recompute_workers.STEPS and off[-1] != off[0]      # it trains
    assert losses["act"] == off and losses["act1"] == off                 # exact float equality
    for name in ("fused_norm", "fused_norm1", "fused_both"):
        assert losses[name] == losses["fused_off"], name


def test_unfused_norm_recompute_differs_only_in_gradient_summation_order(reports):
    """torch.nn.RMSNorm is composite: its input gradient has two terms from inside the norm plus the
    residual's; recomputed, the norm's two are summed first, so the last bit may differ (the fused
    single-op norm above is bitwise)."""
    assert reports["norm"][0] == pytest.approx(reports["off"][0], rel=1e-6, abs=0)


def test_saved_activation_bytes_drop_and_num_layers_limits_it(reports):
    saved = {name: r[1] for name, r in reports.items()}
    # all layers < first layer only < none
    assert saved["act"] < saved["act1"] < saved["off"], saved
    assert saved["fused_norm"] < saved["fused_norm1"] < saved["fused_off"], saved
    assert saved["norm"] < saved["off"], saved
    # two layers alike: recomputing one of them saves half of what recomputing both saves
    assert saved["off"] - saved["act"] == 2 * (saved["off"] - saved["act1"]), saved
    assert saved["fused_off"] - saved["fused_norm"] == 2 * (saved["fused_off"] - saved["fused_norm1"]), saved
    assert saved["fused_both"] < saved["fused_norm"], saved


@pytest.mark.parametrize("argv, message", [
    (["--recompute-norm", "--recompute-norm-num-layers", "0"], "--recompute-norm-num-layers must be >= 1, got 0"),
    (["--recompute-activation-function", "--recompute-activation-function-num-layers", "5", "--num-layers", "4"],
     "--recompute-activation-function-num-layers 5 is more than --num-layers 4"),
    (["--recompute-norm", "--recompute-granularity", "full", "--recompute-method", "uniform"],
     "--recompute-norm with --recompute-granularity full"),
    # Megatron-LM's namespace (the built-in trainers have no --recompute-modules)
    (argparse.Namespace(recompute_activation_function=True, recompute_granularity="selective",
                        recompute_modules=["core_attn", "mlp"]),
     "--recompute-activation-function with --recompute-modules mlp"),
    (["--recompute-norm-num-layers", "2"], "--recompute-norm-num-layers has no effect without --recompute-norm"),
])
def test_bad_values_are_refused_in_one_line(argv, message):
    with pytest.raises(MindSpeedConfigError, match=message) as err:
        plan(argv)
    assert "\n" not in str(err.value)
