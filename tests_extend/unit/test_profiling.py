import json
import os

import pytest
import torch

import mindspeed
from mindspeed.features.base import TRAIN_END, TRAIN_STEP_BEGIN, TRAIN_STEP_END
from mindspeed.adaptor_core import MindSpeedConfigError, plan


def _train(steps, publish):
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for it in range(steps):
        publish(TRAIN_STEP_BEGIN, iteration=it)
        loss = model(torch.randn(4, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        publish(TRAIN_STEP_END, iteration=it)
    publish(TRAIN_END)


def test_profile_window_writes_a_trace_per_rank(tmp_path):
    state = mindspeed.adapt(["--profile", "--profile-step-start", "2", "--profile-step-end", "4",
                             "--profile-level", "level1", "--profile-save-path", str(tmp_path)])
    try:
        _train(6, state.context.publish)
        profiler = state.context.part("profiler")
    finally:
        mindspeed.unadapt()
    trace, summary = profiler.paths
    assert trace.startswith(str(tmp_path / "rank0")) and "steps2-4" in trace
    events = json.load(open(trace))["traceEvents"]
    names = {e.get("name") for e in events}
    assert any("addmm" in (n or "") for n in names)          # the profiled steps' matmuls
    assert oct(os.stat(trace).st_mode & 0o777) == "0o640"
    assert "Name" in open(summary).read()


def test_profile_other_ranks_only_writes_nothing(tmp_path):
    state = mindspeed.adapt(["--profile", "--profile-step-start", "0", "--profile-step-end", "1",
                             "--profile-ranks", "3", "--profile-save-path", str(tmp_path)])
    try:
        _train(2, state.context.publish)
        profiler = state.context.part("profiler")
    finally:
        mindspeed.unadapt()
    assert profiler.paths == [] and not os.listdir(tmp_path)


def test_bad_profile_window_is_refused():
    with pytest.raises(MindSpeedConfigError, match="--profile-step-end"):
        plan(["--profile", "--profile-step-start", "5", "--profile-step-end", "5"])


def test_mindspore_profile_window_writes_mindspore_trace(tmp_path):
    """The same feature on the MindSpore backend: mindspore.profiler records only the window's steps."""
    ms = pytest.importorskip("mindspore")
    import numpy as np
    state = mindspeed.adapt(["--backend", "mindspore", "--profile", "--profile-step-start", "1",
                             "--profile-step-end", "2", "--profile-save-path", str(tmp_path)])
    try:
        dense, square = ms.nn.Dense(16, 16), ms.nn.Dense(16, 16)
        x = ms.Tensor(np.ones((4, 16), np.float32))
        for it in range(3):   # step 1 (the window) runs the second layer only: its ops are the trace's
            state.context.publish(TRAIN_STEP_BEGIN, iteration=it)
            (square if it == 1 else dense)(x).sum().asnumpy()
            state.context.publish(TRAIN_STEP_END, iteration=it)
        state.context.publish(TRAIN_END)
        profiler = state.context.part("profiler")
    finally:
        mindspeed.unadapt()
    (trace,) = [p for p in profiler.paths if p.endswith("trace_view.json")]
    (table,) = [p for p in profiler.paths if p.endswith(".csv")]
    assert trace.startswith(str(tmp_path / "rank0" / "steps1-2"))
    assert "MatMul" in {e.get("name") for e in json.load(open(trace))}
    rows = {line.split(",")[0]: line.split(",")[1] for line in open(table).read().splitlines()[1:]}
    assert rows["MatMul"] == "1"                  # one step profiled, not three
    assert oct(os.stat(trace).st_mode & 0o777) == "0o640"


AUDIT_SCANS = """
import os, sys, tempfile
scanned = []
def listed(event, args):
    if event == "os.scandir" and args and isinstance(args[0], (str, os.PathLike)):     # not a descriptor
        scanned.append(os.fspath(args[0]))
sys.addaudithook(listed)
from mindspeed.backends.mindspore.profiler import MsProfiler
import mindspore
profiler = MsProfiler("cpu", tempfile.mkdtemp())
profiler.start()
(mindspore.ops.ones((2, 2)) * 2).asnumpy()
profiler.stop()
print("SCANNED", [p for p in scanned if os.path.abspath(p).startswith(os.getcwd())])
"""


def test_mindspore_profiler_does_not_walk_the_current_directory(tmp_path):
    """MindSpore's profiler looks for the CANN version under $ASCEND_HOME_PATH, and without it walks the
    current directory (seconds from a project folder with a virtual environment in it): on CPU the
    backend hands it an empty folder instead. An audit hook sees every directory listed."""
    pytest.importorskip("mindspore")
    import subprocess
    import sys
    (tmp_path / "a" / "b").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_HOME_PATH"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", AUDIT_SCANS], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "SCANNED []" in result.stdout, result.stdout[-2000:]
    assert "ASCEND_HOME_PATH" not in env     # and the process's own environment is left as it was
