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
