"""--optimizer-selection fused_ema_adamw on the torch trainer (Megatron-Core GPT, Megatron's optimizers):
the AdamW part gives --optimizer adam's losses and weights bit for bit, weights and EMA follow an fp64
reference over 20 updates, checkpoints in both formats carry the EMA and resume bit for bit, --use-ema
validates with the EMA weights; and the one-line refusals. One worker process runs every training
case (ema_adamw_worker.py)."""
import json
import os
import subprocess
import sys

import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan
from tests_extend.unit import ema_adamw_worker

FP32_ROUNDING = 2 ** -23


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ema_ckpt"))
    result = subprocess.run([sys.executable, "-m", ema_adamw_worker.__name__, root], capture_output=True, text=True,
                            timeout=600, env={k: v for k, v in os.environ.items() if k != "RANK"})
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_adamw_part_is_megatrons_adam_bit_for_bit(report, precision):
    adam, ema = report[precision]["adam"], report[precision]["ema"]
    assert len(ema["losses"]) == ema_adamw_worker.STEPS
    assert ema["losses"] == adam["losses"]
    assert ema["weights"] == adam["weights"]
    assert ema["ema_updates"] == ema_adamw_worker.STEPS          # the hook ran once per update
    assert "ema_params" in ema["state_keys"] and "ema_params" not in adam["state_keys"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_weights_and_ema_follow_the_fp64_reference(report, precision):
    gaps = report[precision]["gaps"]
    # 20 updates of fp32 weights against fp64 ones (the ema's decay crosses from the warm-up to 0.6)
    assert gaps["param"] < 16 * FP32_ROUNDING
    assert gaps["ema"] < 16 * FP32_ROUNDING
    # the EMA of the run's own fp32 weights: a few roundings of one lerp per update
    assert gaps["ema_of_run_weights"] < 4 * FP32_ROUNDING


def test_the_ema_is_four_bytes_per_parameter(report):
    assert report["fp32"]["ema_bytes_per_param"] == 4.0
    assert report["bf16"]["ema_bytes_per_param"] == 4.0     # of the fp32 masters


@pytest.mark.parametrize("case", ["torch_dist ", "torch ", "torch_dist --bf16"])
def test_checkpoints_carry_the_ema_and_resume_bit_for_bit(report, case):
    run = report["resume"][case]
    assert run["on_disk"]["ema_params"] == run["on_disk"]["exp_avg"] > 0
    assert run["loaded_ema_bitwise"]
    assert run["resumed"] == run["continued"]
    assert run["final_ema_bitwise"]


@pytest.mark.parametrize("case", ["torch_dist ", "torch_dist --bf16"])
def test_use_ema_loads_the_saved_ema_into_a_fresh_model(report, case):
    load = report["resume"][case]["use_ema_load"]       # mindspeed.generate / evaluate --use-ema
    assert load["tensors"] > 0 and load["bitwise"], load


def test_use_ema_load_refuses_a_legacy_checkpoint_in_one_line(report):
    refused = report["resume"]["torch "]["use_ema_load"]["refused"]
    assert "--use-ema reads the EMA of the weights from a torch_dist checkpoint" in refused
    assert "\n" not in refused


def test_use_ema_validates_with_the_ema_weights(report):
    run = report["use_ema"]
    assert run["with_ema"] == run["by_hand"]
    assert run["with_ema"] != run["plain"]
    assert run["restored"]


ON = ["--optimizer-selection", "fused_ema_adamw"]


@pytest.mark.parametrize("argv, message", [
    (ON + ["--use-distributed-optimizer", "--ckpt-format", "torch"], "use --ckpt-format torch_dist"),
    (ON + ["--optimizer", "sgd"], "is AdamW: drop --optimizer sgd"),
    (ON + ["--ema-decay", "1"], "--ema-decay must be in [0, 1), got 1.0"),
    (ON + ["--bf16", "--reuse-fp32-param"], "conflicts with 'reuse-fp32-param'"),
    (ON + ["--swap-optimizer"], "conflicts with 'swap-optimizer'"),
    (["--use-ema"], "--use-ema has no effect without --optimizer-selection fused_ema_adamw"),
    (["--ema-decay", "0.9"], "--ema-decay has no effect without --optimizer-selection fused_ema_adamw"),
    (ON + ["--backend", "mindspore"], "AdamWeightDecay graph) keeps no EMA of the weights yet"),
])
def test_bad_combinations_are_refused_in_one_line(argv, message):
    with pytest.raises(MindSpeedConfigError) as err:
        plan(argv, unknown_flags="trainer")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unadapt_restores_what_the_ema_patches():
    import mindspeed
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
    from mindspeed.patching import _raw_get
    classes = (Float16OptimizerWithFloat16Params, FP32Optimizer)
    before = [_raw_get(c, "__init__") for c in classes]
    state = mindspeed.adapt(ON)
    try:
        assert [_raw_get(c, "__init__") is b for c, b in zip(classes, before)] == [False] * 2
        assert "fused-ema-adamw" in {f.id for f in state.plan.features}
    finally:
        mindspeed.unadapt()
    assert [_raw_get(c, "__init__") is b for c, b in zip(classes, before)] == [True] * 2
