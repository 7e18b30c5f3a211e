"""A MindSpore worker that reaches msrun's scheduler port before the scheduler listens waits for it
(mindspeed/backends/mindspore/cluster_start.py) instead of failing its registration and spending
MindSpore's reconnect window: a real one-worker cluster (scheduler + worker processes, the
environment msrun gives them), the worker started first."""
import datetime
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("mindspore")

from mindspeed.backends.mindspore import cluster_start  # noqa: E402
from mindspeed.backends.mindspore.worker_exit import LAUNCHER_ENV  # noqa: E402
from mindspeed.net import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Members end as MindSpeed's workers end (worker_exit.finish): MindSpore's own exit handler now and
# then crashes a finished worker (docs/native-crash.md), which is not what this test is about.
MEMBER = """
import sys
from mindspeed.backends.mindspore.backend import MindSporeBackend
from mindspeed.backends.mindspore.worker_exit import finish
print("imported", flush=True)
backend = MindSporeBackend("cpu")
print("joined as rank", backend.comm.rank(), flush=True)
sys.exit(finish(0))
"""


def test_the_wait_ends_when_the_port_listens():
    port = free_port()
    server = socket.socket()

    def listen_later():
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()
    threading.Thread(target=listen_later).start()
    try:
        assert cluster_start.wait_for_scheduler(("127.0.0.1", port), give_up_s=30)
    finally:
        server.close()


def test_the_wait_gives_up_and_needs_an_msrun_worker(monkeypatch):
    assert not cluster_start.wait_for_scheduler(("127.0.0.1", free_port()), give_up_s=0.2)
    assert not cluster_start.wait_for_scheduler(None)
    monkeypatch.setenv("MS_SCHED_HOST", "127.0.0.1")
    monkeypatch.setenv("MS_SCHED_PORT", "8118")
    monkeypatch.setenv("MS_ROLE", "MS_SCHED")          # the scheduler itself does not wait
    assert cluster_start.scheduler_address() is None
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    assert cluster_start.scheduler_address() == ("127.0.0.1", 8118)


def test_the_heartbeat_interval_is_the_users_when_set():
    environ = {}
    cluster_start.quicker_heartbeat(environ)
    assert environ == {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}
    users = {"MS_RETRY_INTERVAL_UPPER": "9"}
    cluster_start.quicker_heartbeat(users)
    assert users == {"MS_RETRY_INTERVAL_UPPER": "9"}


def _log_times(log: str, marker: str) -> list:
    """Timestamps of the MindSpore log lines holding `marker` (glog's local time, to the microsecond)."""
    stamp = re.compile(r"(\d{4}-\d{2}-\d{2})-(\d{2}:\d{2}:\d{2})\.(\d{3})\.(\d{3})")
    times = []
    for line in log.splitlines():
        found = stamp.search(line) if marker in line else None
        if found:
            day, clock, ms, us = found.groups()
            times.append(datetime.datetime.fromisoformat(f"{day} {clock}.{ms}{us}"))
    return times


def test_a_worker_started_before_the_scheduler_connects_only_once_the_scheduler_listens(tmp_path):
    """The worker's first connection to the scheduler's port comes after the scheduler began to set
    up its server (MindSpore's own log of both processes, GLOG_v=2). A worker that did not wait
    connects at once, seconds before. What MindSpore does after a connection is its own: with the
    scheduler starved of CPU, its event loop has been seen to start 0.35 s after it listened, and
    the worker's first registrations then failed and were retried every 0.5 s."""
    port = str(free_port())
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=port, MS_WORKER_NUM="1", GLOG_v="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    worker_log, scheduler_log = tmp_path / "worker.log", tmp_path / "scheduler.log"
    with open(worker_log, "w") as log, open(scheduler_log, "w") as scheduler_err:
        worker = subprocess.Popen([sys.executable, "-c", MEMBER],
                                  env=dict(env, MS_ROLE="MS_WORKER", MS_NODE_ID="0", **{LAUNCHER_ENV: str(marks)}),
                                  stdout=subprocess.PIPE, stderr=log, text=True)
        scheduler = None
        try:
            assert worker.stdout.readline().strip() == "imported"
            time.sleep(1.0)               # the worker is inside its join, the scheduler not started yet
            scheduler = subprocess.Popen([sys.executable, "-c", MEMBER], env=dict(env, MS_ROLE="MS_SCHED"),
                                         stdout=subprocess.DEVNULL, stderr=scheduler_err)
            out, _ = worker.communicate(timeout=180)
        finally:
            worker.kill()
            if scheduler is not None:     # as mindspeed.msrun does once its workers left their marks
                scheduler.kill()
                scheduler.wait()
    assert worker.returncode == 0 and "joined as rank 0" in out, worker_log.read_text()[-2000:]
    assert len(list(marks.iterdir())) == 1, "the worker did not end through worker_exit.finish"
    scheduler_stderr = scheduler_log.read_text()
    server_setup = _log_times(scheduler_stderr, "Begin to Initialize MetaServerNode")
    connects = _log_times(worker_log.read_text(), f"destination: 127.0.0.1:{port}")
    assert server_setup and connects, (scheduler_stderr[-2000:], worker_log.read_text()[-2000:])
    assert connects[0] >= server_setup[0], f"first connection {connects[0]}, scheduler set up at {server_setup[0]}"
