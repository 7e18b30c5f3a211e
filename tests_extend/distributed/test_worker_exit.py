"""How MindSpore workers end under `python -m mindspeed.msrun` (mindspeed/backends/mindspore/worker_exit.py):
once every rank succeeded, without the exit handlers (MindSpore's own crashes a finished worker now
and then), and the launcher ends the job's scheduler itself."""
import os

import pytest

pytest.importorskip("mindspore")

from mindspeed.backends.mindspore import worker_exit  # noqa: E402
from tests_extend.distributed.msrun_helper import run_msrun  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_exit_worker.py")


SLOW = pytest.mark.skipif(not os.environ.get("MINDSPEED_SLOW_TESTS"), reason="MINDSPEED_SLOW_TESTS=1 runs it")


def _launch(tmp_path, monkeypatch, nodes: int, collectives: str, delay: int) -> list:
    monkeypatch.setenv("MINDSPEED_MS_SHM_COLLECTIVES", "1" if collectives == "shared memory" else "0")
    results = run_msrun(WORKER, [str(tmp_path), str(delay)], str(tmp_path), workers=2, timeout=240, nodes=nodes)
    assert all(r["ok"] for r in results)
    assert results[1]["finished_at"] - results[0]["finished_at"] > delay - 2
    return sorted(p.name for p in tmp_path.glob("exit_handlers_ran*"))


def test_finished_workers_leave_together_without_exit_handlers(tmp_path, monkeypatch):
    """Rank 1 works 12 s longer than rank 0, and the scheduler times out a node after 6 s without
    heartbeats: rank 0 must wait for rank 1 before it leaves (else the scheduler fails the job and
    stops rank 1), neither runs its exit handlers, and the job ends with exit code 0 though no
    worker told the scheduler it was leaving (one node, the shared-memory collectives)."""
    monkeypatch.setenv("MS_NODE_TIMEOUT", "6")
    assert _launch(tmp_path, monkeypatch, 1, "shared memory", 12) == [], "a worker ran its exit handlers"


def test_on_two_nodes_over_mccl_too(tmp_path, monkeypatch):
    """Two launchers on this machine acting as two nodes, one worker each, the world on MCCL; rank
    1 4 s later (within MCCL's receive timeout): both nodes' launchers exit 0 and no exit handler ran."""
    assert _launch(tmp_path, monkeypatch, 2, "MCCL", 4) == [], "a worker ran its exit handlers"


@SLOW
def test_a_peer_later_than_mccls_timeout_gets_the_normal_exit(tmp_path, monkeypatch):
    """Rank 1 12 s later, past MCCL's receive timeout (about 10 s): the agreement fails on both
    ranks, each ends as Python ends it (its exit handlers run) and the job still succeeds."""
    monkeypatch.setenv("MS_NODE_TIMEOUT", "6")
    assert _launch(tmp_path, monkeypatch, 2, "MCCL", 12) == ["exit_handlers_ran0", "exit_handlers_ran1"]


def test_without_mindspeeds_launcher_a_worker_ends_as_python_ends_it(monkeypatch, tmp_path):
    """Plain msrun does not end the scheduler, which would wait for the workers' goodbye: finish
    hands the code back untouched, for the normal exit; so does the scheduler process."""
    monkeypatch.delenv(worker_exit.LAUNCHER_ENV, raising=False)
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    assert worker_exit.finish(0) == 0 and worker_exit.finish(3) == 3
    monkeypatch.setenv(worker_exit.LAUNCHER_ENV, str(tmp_path))
    monkeypatch.setenv("MS_ROLE", "MS_SCHED")          # the scheduler process is never ended this way
    assert worker_exit.finish(0) == 0
    assert not list(tmp_path.iterdir())


def test_the_launcher_ends_the_scheduler_only_once_every_worker_agreed_and_exited_0(tmp_path):
    """mindspeed.msrun's check before it stops the scheduler: every local worker exited 0 and left
    its mark (it agreed with all ranks that each succeeded); a worker that exited 0 by the normal
    exit (some rank failed) leaves no mark, and the scheduler is then waited for as msrun does."""
    import subprocess
    import sys

    from mindspeed.msrun import FailFastProcessManager
    manager = object.__new__(FailFastProcessManager)          # the check alone, without msrun's arguments
    manager.marks = str(tmp_path)
    exited = [subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"]) for code in (0, 0, 3)]
    for proc in exited:
        proc.wait()
    manager.cgn_processes = exited[:2]
    assert not manager._all_agreed()
    (tmp_path / "101.done").touch()
    assert not manager._all_agreed()
    (tmp_path / "102.done").touch()
    assert manager._all_agreed()
    manager.cgn_processes = exited[1:]                         # one worker failed
    assert not manager._all_agreed()
