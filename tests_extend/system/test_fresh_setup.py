"""What a fresh setup must hold, run in every environment the project supports. `.ci/run` also runs
this file in a virtual environment built exactly as README command 1 builds it for `--backend torch`
on Debian's own Python (the core and test groups of mindspeed/versions.py, nothing else), so a
package the torch path needs but the setup does not install fails here."""
import os
import pkgutil
import subprocess
import sys
import time

import mindspeed
from tests_extend.system.test_pretrain_gpt import ROOT, launch_example, read_losses, run_example

NO_PSUTIL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_injection", "no_psutil_on_one_rank")
# modules that need a package outside the torch setup's groups, and the group or step that brings it
OPTIONAL = {"mindspore": "the mindspore group (--backend mindspore)",
            "megatron.training": "a Megatron-LM checkout (auto_convert_llm.sh --fetch)",
            "torch_npu": "Ascend's torch_npu with CANN (NPU machines only)"}
SAVE_ENV = dict(TP="2", PP="1", TRAIN_ITERS="4", EVAL_INTERVAL="100", EVAL_ITERS="0", SAVE_INTERVAL="2")


def test_every_module_of_the_torch_path_imports():
    """Each mindspeed module imported in a fresh interpreter; a missing package is allowed only
    where OPTIONAL names what brings it."""
    names = [m.name for m in pkgutil.walk_packages(mindspeed.__path__, "mindspeed.")
             if not m.name.endswith("__main__")]
    script = ("import importlib, sys, json\nmissing = {}\nfor name in sys.argv[1:]:\n"
              "    try:\n        importlib.import_module(name)\n"
              "    except ModuleNotFoundError as err:\n        missing[name] = err.name\n"
              "print(json.dumps(missing))\n")
    done = subprocess.run([sys.executable, "-c", script, *names], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert done.returncode == 0, done.stderr[-3000:]
    import json
    missing = json.loads(done.stdout.strip().splitlines()[-1])
    unexplained = {module: package for module, package in missing.items()
                   if not any(package == opt or package.startswith(opt + ".") for opt in OPTIONAL)}
    assert not unexplained, f"modules whose packages the setup does not install: {unexplained}"
    assert len(names) > 100


def test_save_then_resume_continues_the_run(tmp_path):
    """README command 1's job with CKPT_DIR and SAVE_INTERVAL, then LOAD_DIR: the resumed steps
    repeat the uninterrupted run's (the save path needs psutil, the resume reads the index)."""
    ckpt, full, resumed = tmp_path / "ckpt", tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    run_example(dict(SAVE_ENV, CKPT_DIR=str(ckpt)), ["--deterministic-mode", "--log-loss-file", str(full)])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    output = run_example(dict(SAVE_ENV, LOAD_DIR=str(ckpt), TRAIN_ITERS="6"),
                         ["--deterministic-mode", "--ckpt-step", "2", "--log-loss-file", str(resumed)])
    assert "loaded checkpoint" in output and "at iteration 2" in output
    a, b = read_losses(full), read_losses(resumed)
    assert sorted(b) == [3, 4, 5, 6]
    for it in (3, 4):
        assert abs(a[it] - b[it]) <= 1e-6, (it, a[it], b[it])


def test_a_save_that_fails_on_one_rank_ends_the_job_with_one_line(tmp_path):
    """psutil missing on rank 1 only: Megatron's writer process raises before it marks itself done
    (which used to hang every rank); now the failure reaches Megatron's own gather, every rank exits
    with one line (rank 0's names rank 1 and the cause), and the tracker names no half-written
    checkpoint."""
    ckpt = tmp_path / "ckpt"
    env = dict(SAVE_ENV, CKPT_DIR=str(ckpt), MINDSPEED_TEST_NO_PSUTIL_RANK="1",
               PYTHONPATH=NO_PSUTIL + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    result = launch_example(env, timeout=300)
    took = time.monotonic() - start
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert result.returncode != 0, output[-3000:]
    assert len(errors) == 2, output[-4000:]                 # one per rank
    named = [line for line in errors if "failed on rank 1" in line and "psutil" in line]
    assert len(named) == 1 and "iter_0000002" in named[0], errors
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()
    assert took < 150, f"the job took {took:.0f} s to end"


def _unsupported_python():
    """Another CPython on this machine (pyenv's, or on PATH), or None."""
    import glob
    import shutil
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3")))
    candidates += [shutil.which(f"python3.{minor}") for minor in (9, 10, 12, 13)]
    for path in filter(None, candidates):
        version = subprocess.run([path, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                 text=True).stdout.strip()
        if version and version != "(3, 11)":
            return path
    return None


def test_the_setup_refuses_another_python_with_one_line(tmp_path):
    other = _unsupported_python()
    if other is None:
        import pytest
        pytest.skip("no Python other than 3.11 on this machine to try")
    venv = tmp_path / "venv"
    done = subprocess.run(["bash", os.path.join(ROOT, "auto_convert_llm.sh"), "--python", other, "--venv", str(venv)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    errors = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(errors) == 1, done.stdout + done.stderr
    assert errors[0].startswith("error: Python 3.") and "is not supported" in errors[0] and ">=3.11,<3.12" in errors[0]
    assert not venv.exists()                     # refused before anything is made
    from mindspeed import versions
    assert versions.PYTHON_REQUIRES == ">=3.11,<3.12"
    setup_py = open(os.path.join(ROOT, "setup.py")).read()
    assert 'python_requires=V["PYTHON_REQUIRES"]' in setup_py    # pip refuses the same Pythons
