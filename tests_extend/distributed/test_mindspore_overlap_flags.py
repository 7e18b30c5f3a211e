"""--overlap-grad-reduce and --overlap-param-gather on the MindSpore trainer (emulated: the same
reductions and gathers, run after the backward pass and right after the update instead of
overlapped): with DP=2 on 2 msrun processes the losses equal the run without the flags bit for
bit, with plain data parallelism and with the distributed optimizer, as the torch trainer's test
(tests_extend/distributed/test_pipeline_layers.py) finds for Megatron's overlap. One launch trains
every run in turn (matrix_walk_ms_worker.py)."""
import json
import os

import pytest

from mindspeed.backends.base import Level
from mindspeed.features.registry import get_feature
from mindspeed.support_matrix import feature_level
from tests_extend.system import matrix_walk as walk

STEPS = ["--train-iters", "4"]     # after TINY's 2: the last one counts
ZERO = ["--use-distributed-optimizer"]
RUNS = {"ddp": [], "ddp overlapped": ["--overlap-grad-reduce"],
        "zero": ZERO, "zero overlapped": ZERO + ["--overlap-grad-reduce", "--overlap-param-gather"]}


def test_the_matrix_says_emulated_with_why():
    for name in ("overlap-grad-reduce", "overlap-param-gather"):
        level, limits = feature_level(get_feature(name), "mindspore", "cpu")
        assert level is Level.EMULATED and any("not overlapped" in lim for lim in limits), limits


@pytest.mark.timeout(960)
def test_the_losses_with_the_flags_equal_those_without(tmp_path, monkeypatch):
    pytest.importorskip("mindspore")
    from tests_extend.distributed.msrun_helper import run_msrun
    monkeypatch.setenv("WORLD_SIZE", str(walk.WORLD))     # as train_distributed_ms.sh exports it for msrun
    cells = [(name, walk.TINY + walk.MOCK + STEPS + flags + ["--backend", "mindspore"]) for name, flags in RUNS.items()]
    (tmp_path / "cells.json").write_text(json.dumps(cells))
    worker = os.path.join(walk.ROOT, "tests_extend", "system", "matrix_walk_ms_worker.py")
    trained = run_msrun(worker, [str(tmp_path / "cells.json"), str(tmp_path)], str(tmp_path), timeout=900)[0]
    assert all(r["trained"] for r in trained.values()), trained       # (rank 0 writes the losses)
    losses = {name: r["losses"] for name, r in trained.items()}
    assert all(len(run) == 4 for run in losses.values()), losses
    assert losses["ddp overlapped"] == losses["ddp"], losses
    assert losses["zero overlapped"] == losses["zero"], losses
