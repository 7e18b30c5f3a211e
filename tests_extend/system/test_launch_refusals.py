"""A flag the trainer refuses stops train_distributed.sh / train_distributed_ms.sh with the trainer's
one `error:` line (the preflight, mindspeed.preflight) before torchrun/msrun start: no
launcher traceback, nothing launched. The launchers are replaced by recorders, so a launch that
should not happen is seen (and does not train)."""
import os
import stat
import sys
import time

import pytest

from tests_extend.system import megatron_lm_kit
from tests_extend.system.test_pretrain_gpt import launch_example

LAUNCHER_REACHED = 99       # the recorders' exit code
FEW_SECONDS = 90            # a refusal imports torch (or MindSpore) once, on 2 busy cores; a launch is slower


def _recorder(directory, name: str, body: str):
    """An executable `name` in `directory` that appends its arguments to calls.log, then runs body."""
    os.makedirs(directory, exist_ok=True)
    log = os.path.join(directory, "calls.log")
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> "{log}"\n{body}\n')
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path, log


def _python_recorder(tmp_path, launcher="mindspeed.torchrun"):
    """$PYTHON for the launch scripts: runs python, except the launcher (recorded, not started)."""
    return _recorder(str(tmp_path / "bin"), "python",
                     f'case "$*" in *{launcher}*) exit {LAUNCHER_REACHED};; esac\n'
                     f'exec "{sys.executable}" "$@"')


def _calls(log):
    return open(log).read().splitlines() if os.path.exists(log) else []


def assert_refused_before_launch(result, elapsed, expected, launched):
    """Exit 2, stderr exactly one `error:` line naming `expected`, no traceback, nothing launched."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert "Traceback" not in output and result.stdout == "", output[-3000:]
    assert not launched, launched
    assert elapsed < FEW_SECONDS, f"refusal took {elapsed:.0f}s"


TORCH_REFUSALS = [
    ("pipeline stages", dict(TP="1", PP="2"), ["--num-layers", "3"],
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    ("world size", dict(TP="1", PP="2", NPUS_PER_NODE="3"), [],
     "world size 3 is not divisible by tensor (1) x pipeline (2)"),
    ("unknown flag", {}, ["--use-distributed-optimiser"], "--use-distributed-optimiser"),
    ("invalid choice", {}, ["--optimizer", "adamw"], "invalid choice: 'adamw'"),
    ("orphan --ckpt-step", {}, ["--ckpt-step", "4"], "--ckpt-step needs --load"),
]


@pytest.mark.parametrize("name, env, args, expected", TORCH_REFUSALS, ids=[c[0] for c in TORCH_REFUSALS])
def test_torch_script_refuses_before_torchrun(tmp_path, name, env, args, expected):
    python, log = _python_recorder(tmp_path)
    start = time.monotonic()
    result = launch_example(dict(env, PYTHON=python), args, timeout=120)
    launched = [c for c in _calls(log) if "mindspeed.torchrun" in c]
    assert_refused_before_launch(result, time.monotonic() - start, expected, launched)


def test_torch_script_launches_what_the_preflight_accepts(tmp_path):
    """The control: accepted flags reach torchrun, with the trainer's argv."""
    python, log = _python_recorder(tmp_path)
    result = launch_example(dict(PYTHON=python, TP="1", PP="2"), ["--num-layers", "4"], timeout=120)
    assert result.returncode == LAUNCHER_REACHED, (result.stdout + result.stderr)[-3000:]
    calls = _calls(log)
    assert calls[0].startswith("-m mindspeed.preflight --preflight-world-size 2 ")
    assert calls[-1].startswith("-m mindspeed.torchrun") and "pretrain_gpt.py" in calls[-1]
    assert calls[-1].endswith("--num-layers 4") and calls[0].endswith("--num-layers 4")


def test_help_is_printed_once_and_nothing_launched(tmp_path):
    python, log = _python_recorder(tmp_path)
    result = launch_example(dict(PYTHON=python), ["--help"], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("usage: pretrain_gpt.py") == 1 and "--no-load-optim" in result.stdout
    assert not [c for c in _calls(log) if "mindspeed.torchrun" in c]


def test_megatron_lm_script_is_not_preflighted(tmp_path):
    """MEGATRON_LM: Megatron-LM's own parser decides, so its flags go straight to torchrun."""
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text(f"import torch\n{megatron_lm_kit.IMPORT_LINE}\n")
    python, log = _python_recorder(tmp_path)
    result = megatron_lm_kit.launch(str(checkout), 2, ["--a-megatron-lm-only-flag"],
                                    env=dict(PYTHON=python, MOCK_DATA="1"), timeout=120)
    assert result.returncode == LAUNCHER_REACHED, (result.stdout + result.stderr)[-3000:]
    calls = _calls(log)
    assert not [c for c in calls if "preflight" in c], calls
    assert "mindspeed.torchrun" in calls[-1] and calls[-1].endswith("--a-megatron-lm-only-flag")


MINDSPORE_REFUSALS = [
    ("swap optimizer", ["--swap-optimizer"],
     "(--swap-optimizer) is not supported on backend 'mindspore'"),
    ("orphan --ckpt-step", ["--ckpt-step", "4"], "--ckpt-step needs --load"),
    ("unknown flag", ["--sequence-paralel"], "--sequence-paralel"),
]


def _ms_launch(tmp_path, name, args, env=None):
    """train_distributed_ms.sh with its launcher (python -m mindspeed.msrun) recorded: (result,
    seconds, the launcher's argument lines)."""
    ms_script = pytest.importorskip("tests_extend.system.test_mindspore_train_script")
    python, log = _python_recorder(tmp_path, "mindspeed.msrun")
    _recorder(os.path.dirname(python), "msrun", f"exit {LAUNCHER_REACHED}")   # where the script finds msrun
    path = os.path.dirname(python) + os.pathsep + os.environ.get("PATH", "")
    start = time.monotonic()
    result = ms_script.launch(tmp_path, name, dict(env or {}, PYTHON=python, PATH=path), args, timeout=120)
    return result, time.monotonic() - start, [c for c in _calls(log) if "mindspeed.msrun" in c]


@pytest.mark.parametrize("name, args, expected", MINDSPORE_REFUSALS, ids=[c[0] for c in MINDSPORE_REFUSALS])
def test_mindspore_script_refuses_before_msrun(tmp_path, name, args, expected):
    result, elapsed, msrun_calls = _ms_launch(tmp_path, "refused", args)
    assert_refused_before_launch(result, elapsed, expected, msrun_calls)
    assert not (tmp_path / "refused_logs").exists()      # msrun's worker logs


def test_mindspore_script_launches_what_the_preflight_accepts(tmp_path):
    """Also MAX_RESTARTS=2: msrun (the recorder exits non-zero) is launched 1 + 2 times, each resuming
    from CKPT_DIR, then the script gives up with msrun's code; without CKPT_DIR it is one error line."""
    ckpt = str(tmp_path / "ckpt")
    result, _elapsed, msrun_calls = _ms_launch(tmp_path, "accepted", ["--num-layers", "2"],
                                               dict(MAX_RESTARTS="2", CKPT_DIR=ckpt, SAVE_INTERVAL="4"))
    assert result.returncode == LAUNCHER_REACHED, (result.stdout + result.stderr)[-3000:]
    assert len(msrun_calls) == 3 and all(call == msrun_calls[0] for call in msrun_calls), msrun_calls
    assert "--worker_num=2" in msrun_calls[0] and f"--save {ckpt} --save-interval 4 --load {ckpt}" in msrun_calls[0]
    assert "--backend mindspore" in msrun_calls[0] and msrun_calls[0].endswith("--num-layers 2")
    assert [line.split(":")[1].strip() for line in result.stderr.splitlines() if "restart" in line] == [
        f"restart {n} of 2, from the last checkpoint in {ckpt}" for n in (1, 2)], result.stderr
    result, _elapsed, msrun_calls = _ms_launch(tmp_path, "no-ckpt", [], dict(MAX_RESTARTS="1"))
    assert result.returncode == 2 and not msrun_calls[3:], msrun_calls
    assert result.stderr.strip() == ("error: MAX_RESTARTS=1 needs CKPT_DIR and SAVE_INTERVAL: a restarted job "
                                     "resumes from the last checkpoint")
