"""mindspeed.preflight in-process: the launch's world size reaches parse_args, refusals
and its own option errors are one `error:` line with exit 2, and a torch preflight stays light
(no megatron.core, no MindSpore). The launch scripts' use: tests_extend/system/test_launch_refusals.py."""
import subprocess
import sys

import pytest

from mindspeed import preflight

SIZES = ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--micro-batch-size", "1"]


def _main(capsys, argv):
    code = preflight.main(argv)
    return code, capsys.readouterr().err.splitlines()


def test_the_launch_world_size_is_the_one_checked(capsys, monkeypatch):
    monkeypatch.delenv(preflight.WORLD_SIZE_ENV, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _main(capsys, ["--preflight-world-size", "4", *SIZES]) == (0, [])
    assert _main(capsys, ["--preflight-world-size=2", *SIZES]) == (0, [])
    code, err = _main(capsys, ["--preflight-world-size", "3", *SIZES])
    assert code == preflight.REFUSED and len(err) == 1
    assert err[0].startswith("error: world size 3 is not divisible by tensor (2)")
    monkeypatch.setenv(preflight.WORLD_SIZE_ENV, "6")
    assert _main(capsys, SIZES)[0] == 0
    monkeypatch.setenv(preflight.WORLD_SIZE_ENV, "5")
    assert "world size 5" in _main(capsys, SIZES)[1][0]


@pytest.mark.parametrize("argv, expected", [
    (["--preflight-world-size"], "error: preflight: --preflight-world-size needs a value"),
    (["--preflight-world-size", "two"], "error: preflight: --preflight-world-size / "),
    (["--preflight-world-size", "1", "--optimizer", "adamw"], "error: argument --optimizer: invalid choice"),
    (["--preflight-world-size", "1", "--ckpt-step", "3"], "error: --ckpt-step needs --load"),
])
def test_errors_are_one_line_with_exit_2(capsys, argv, expected):
    code, err = _main(capsys, argv)
    assert code == preflight.REFUSED and len(err) == 1 and err[0].startswith(expected), err


def test_help_is_not_a_refusal(capsys):
    assert preflight.main(["--help"]) == preflight.HELP_SHOWN
    assert "usage: pretrain_gpt.py" in capsys.readouterr().out


def test_a_torch_preflight_imports_neither_megatron_core_nor_mindspore():
    """Nor torch where the installed torch is a CPU-only build (this machine's: the device is known
    without asking torch, backends/torch/device_select.py)."""
    from mindspeed.backends.torch.device_select import cpu_only_torch
    code = ("import sys; from mindspeed.preflight import main; rc = main(['--preflight-world-size', '2']);"
            "print(rc, sorted(m for m in ('megatron.core', 'mindspore', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    expected = "0 []" if cpu_only_torch() else "0 ['torch']"
    assert result.stdout.split("\n")[-2] == expected, result.stdout + result.stderr


def test_the_mindspore_trainers_config_errors_are_refusals_and_bugs_are_not(capsys, monkeypatch):
    import mindspeed.adaptor_core as core
    trainer = pytest.importorskip("mindspeed.training.mindspore.trainer")

    def refuse(_args):
        raise trainer.TrainerConfigError("--context-parallel-size > 1 needs a context-parallel algorithm")
    monkeypatch.setattr(core, "plan", refuse)
    code, err = _main(capsys, ["--preflight-world-size", "1", "--backend", "mindspore"])
    assert (code, err) == (preflight.REFUSED, ["error: --context-parallel-size > 1 needs a context-parallel algorithm"])

    def crash(_args):
        raise KeyError("a bug")
    monkeypatch.setattr(core, "plan", crash)
    with pytest.raises(KeyError):
        preflight.main(["--preflight-world-size", "1"])
