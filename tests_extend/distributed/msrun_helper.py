"""Launch a worker script on N MindSpore processes with msrun (`python -m mindspeed.msrun`, as the
launch script does), with a timeout so a hung collective fails the test. Workers write results as
JSON files into `out_dir` and end with end_worker(), as MindSpeed's own entry points end."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
import uuid

from mindspeed.net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class MsrunError(AssertionError):
    """msrun failed, timed out, or a rank wrote no result; carries the workers' log tails."""


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tail(path: str, n: int = 60) -> str:
    lines = [l for l in _read(path).splitlines() if "WARNING" not in l]
    return "\n".join(lines[-n:]) if lines else "(no log)"


def run_msrun(script: str, args: list, out_dir: str, *, workers: int = 2, timeout: float = 240,
              nodes: int = 1) -> list:
    """Run `script args...` on `workers` msrun processes (split over `nodes` launches on this
    machine acting as nodes); return each rank's JSON result (out_dir/rank{r}.json, written by the
    worker). Any failure fails the test at once: a crashed worker is a defect to find, never
    launched again (PYTHONFAULTHANDLER puts its stack in its log)."""
    bindir = os.path.dirname(sys.executable)
    # PYTHONFAULTHANDLER: a worker that dies of a signal inside MindSpore prints its Python stack to its log
    launch = uuid.uuid4().hex       # in every process of this launch's environment: found and ended after it
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), GLOG_v="3", PYTHONFAULTHANDLER="1",
               MINDSPEED_MSRUN_LAUNCH=launch,
               PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    env.setdefault("OMP_NUM_THREADS", "1")    # as train_distributed_ms.sh exports it: one compute thread per process
    log_dir = os.path.join(out_dir, "msrun_logs")
    port = free_port()
    procs = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "mindspeed.msrun", f"--worker_num={workers}",
               f"--local_worker_num={workers // nodes}", f"--master_port={port}", "--master_addr=127.0.0.1",
               f"--node_rank={node}", "--join=True", f"--log_dir={log_dir}", "--cluster_time_out=120",
               script, *map(str, args)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for each in procs:
                try:
                    os.killpg(each.pid, signal.SIGKILL)      # msrun and the workers it spawned
                except ProcessLookupError:
                    pass
                each.communicate()
            raise MsrunError(f"msrun {os.path.basename(script)} timed out after {timeout}s\n"
                             + "\n".join(_tail(p) for p in sorted(glob.glob(os.path.join(log_dir, "worker_*.log")))))
    failed = [proc for proc in procs if proc.returncode != 0]
    for proc in failed:
        _end_leftover_workers(proc.pid, launch)
    out = "\n".join(outputs)
    results = []
    for rank in range(workers):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if failed or not os.path.isfile(path):
            paths = sorted(glob.glob(os.path.join(log_dir, "worker_*.log")))
            raise MsrunError(f"msrun {os.path.basename(script)} failed (rc {[p.returncode for p in procs]}); no result "
                             f"from rank {rank}\n{out[-3000:]}\n" + "\n".join(f"--- {p}\n{_tail(p)}" for p in paths))
        with open(path) as f:
            results.append(json.load(f))
    return results


def _end_leftover_workers(group: int, launch: str) -> None:
    """msrun can exit after a worker died while another worker of that launch is still starting;
    that one would write its result into the next launch's folder. End the launch's whole group,
    and every process carrying the launch's mark (msrun's workers may sit in groups of their own),
    until none is left."""
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    mark = f"MINDSPEED_MSRUN_LAUNCH={launch}".encode()
    for _ in range(100):
        left = [pid for pid in _pids() if mark in _environ(pid)]
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and int(name) != os.getpid()]


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:       # gone, or not ours
        return b""


_results_ok = []       # this worker's results so far: did each say ok


def write_result(out_dir: str, rank: int, result) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    _results_ok.append(bool(result.get("ok", True)) if isinstance(result, dict) else True)


def end_worker() -> None:
    """A worker's last call. Where every rank's results were ok it ends as the trainer's workers
    end (worker_exit.finish: without MindSpore's exit handler under mindspeed.msrun); otherwise
    as before, exit code 0 with the failure in the result file for the test to show."""
    from mindspeed.backends.mindspore.worker_exit import finish
    finish(0 if _results_ok and all(_results_ok) else 1)
    sys.exit(0)
