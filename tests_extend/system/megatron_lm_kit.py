"""Megatron-LM snapshots for the system tests: find them, unpack one as a user's checkout (with
the one import line added to its pretrain_gpt.py), launch it through train_distributed.sh.

Snapshots: $MINDSPEED_MEGATRON_LM_SNAPSHOTS, else ../shared/megatron-lm/ next to the checkout
(files Megatron-LM-core_v<version>.tar.gz). The project never needs them to run.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys

import pytest

from mindspeed.files import safe_extract
from mindspeed.net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests_extend", "example", "train_distributed.sh")
SNAPSHOT_ENV = "MINDSPEED_MEGATRON_LM_SNAPSHOTS"
VERSIONS = ("0.12.1", "0.16.1")
IMPORT_LINE = "import mindspeed.megatron_adaptor"
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")

# a model that trains in seconds; every run of the matrix uses it (at lr 1e-2 PP+VPP on the test
# corpus spiked and Megatron's rerun state machine stopped the run to checkpoint)
TINY = dict(NUM_LAYERS="4", HIDDEN_SIZE="64", NUM_HEADS="4", SEQ_LENGTH="64", MICRO_BATCH="2",
            GLOBAL_BATCH="8", TRAIN_ITERS="10", LR="5e-3", MIN_LR="5e-4", WARMUP_ITERS="1",
            LOG_INTERVAL="1", EVAL_INTERVAL="1000", EVAL_ITERS="0", SPLIT="90,10,0")


def snapshot_dir() -> str | None:
    candidates = [os.environ.get(SNAPSHOT_ENV), os.path.join(os.path.dirname(ROOT), "shared", "megatron-lm")]
    return next((c for c in candidates if c and os.path.isdir(c)), None)


def snapshot(version: str) -> str | None:
    directory = snapshot_dir()
    path = directory and os.path.join(directory, f"Megatron-LM-core_v{version}.tar.gz")
    return path if path and os.path.isfile(path) else None


def checkout_or_skip(version: str, tmp_path_factory) -> str:
    """A pytest fixture's body: the run's checkout of `version` (shared_checkout), or skip saying
    where the snapshot is looked for."""
    if snapshot(version) is None:
        pytest.skip(f"no Megatron-LM core_v{version} snapshot: set ${SNAPSHOT_ENV} or provide "
                    f"../shared/megatron-lm/ (CI has it)")
    return shared_checkout(version, tmp_path_factory)


def shared_checkout(version: str, tmp_path_factory) -> str:
    """One checkout of `version` per test run, shared by its modules and its xdist workers. The
    tests only read the checkout (with_dataset_helpers builds once in it)."""
    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent            # the run's folder, above each worker's own
    dest = os.path.join(str(run_dir), f"megatron-lm-{version}")
    with open(dest + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(dest, ".ready")):
            shutil.rmtree(dest, ignore_errors=True)
            unpack_checkout(version, dest)
            open(os.path.join(dest, ".ready"), "w").close()
    return dest


def with_dataset_helpers(checkout: str) -> str:
    """The checkout, with Megatron's C++ dataset helpers built once, before the first launch that
    trains (13 s; the runs that stop at parsing or import never need them): each job would otherwise
    build them itself on rank 0, and two jobs building in one checkout could load each other's
    half-written library."""
    with open(checkout + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(checkout, ".helpers")):
            _build_dataset_helpers(checkout)
            open(os.path.join(checkout, ".helpers"), "w").close()
    return checkout


def _build_dataset_helpers(checkout: str) -> None:
    """What Megatron's compile_helpers() runs on rank 0 at start, with this interpreter's python3."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    result = subprocess.run(["make", "-C", os.path.join(checkout, "megatron", "core", "datasets")], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def unpack_checkout(version: str, dest: str) -> str:
    """A user's Megatron-LM checkout: the snapshot with the import line under `import torch`."""
    safe_extract(snapshot(version), dest)
    script = os.path.join(dest, "pretrain_gpt.py")
    lines = open(script).read().split("\n")
    at = lines.index("import torch")
    lines.insert(at + 1, IMPORT_LINE)
    with open(script, "w") as f:
        f.write("\n".join(lines))
    return dest


FEATURE_IDS = re.compile(r"[a-z0-9-]+(?:, [a-z0-9-]+)*")


def launch(checkout: str, nproc: int, args=(), env=None, timeout: int = 420) -> subprocess.CompletedProcess:
    """train_distributed.sh with MEGATRON_LM=checkout (the user's way), tiny model."""
    full_env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=str(free_port()), MEGATRON_LM=checkout,
                    NPUS_PER_NODE=str(nproc), TP="1", PP="1", CP="1", EP="1", FUSED="0", **TINY)
    full_env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + full_env.get("PATH", "")  # helpers build
    # each rank's lines reach the shared pipe whole: block-buffered output is flushed at 8 KB
    # boundaries, which cut rank 0's feature line once with another rank's warning in between
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def mindspeed_features(output: str) -> set[str]:
    """The features MindSpeed's rank-0 line reports (feature ids only: whatever another process's
    output put after them on the same line is not one)."""
    line = next(l for l in output.splitlines() if "> MindSpeed backend" in l)
    listed = line.split("> MindSpeed backend", 1)[1].split("features: ", 1)[1]
    ids = FEATURE_IDS.match(listed)        # no match: "(none)"
    return set(ids.group(0).split(", ")) if ids else set()


def losses(output: str) -> dict[int, float]:
    return {int(it): float(loss) for it, loss in LOSS.findall(output)}
