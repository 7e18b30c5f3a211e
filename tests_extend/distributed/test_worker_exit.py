"""How MindSpore workers end under `python -m mindspeed.msrun` (mindspeed/backends/mindspore/worker_exit.py):
once every rank succeeded, without the exit handlers (MindSpore's own crashes a finished worker now
and then), and the launcher ends the job's scheduler itself."""
import os

import pytest

pytest.importorskip("mindspore")

from mindspeed.backends.mindspore import worker_exit  # noqa: E402
from tests_extend.distributed.msrun_helper import run_msrun  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_exit_worker.py")


def test_finished_workers_leave_together_without_exit_handlers(tmp_path, monkeypatch):
    """Rank 1 works 12 s longer than rank 0, and the scheduler times out a node after 6 s without
    heartbeats: rank 0 must wait for rank 1 before it leaves (else the scheduler fails the job and
    stops rank 1), neither runs its exit handlers, and the job ends with exit code 0 though no
    worker told the scheduler it was leaving."""
    monkeypatch.setenv("MS_NODE_TIMEOUT", "6")
    results = run_msrun(WORKER, [str(tmp_path), "12"], str(tmp_path), workers=2, timeout=240)
    assert all(r["ok"] for r in results)
    assert results[1]["finished_at"] - results[0]["finished_at"] > 10
    assert not list(tmp_path.glob("exit_handlers_ran*")), "a worker ran its exit handlers (MindSpore's among them)"


def test_without_mindspeeds_launcher_a_worker_ends_as_python_ends_it(monkeypatch):
    """Plain msrun (or a multi-node job) does not end the scheduler, which would wait for the
    workers' goodbye: finish hands the code back untouched, for the normal exit."""
    monkeypatch.delenv(worker_exit.LAUNCHER_ENV, raising=False)
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    assert worker_exit.finish(0) == 0 and worker_exit.finish(3) == 3
    monkeypatch.setenv(worker_exit.LAUNCHER_ENV, "1")
    monkeypatch.setenv("MS_ROLE", "MS_SCHED")          # the scheduler process is never ended this way
    assert worker_exit.finish(0) == 0
