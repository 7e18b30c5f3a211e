"""Launch a worker script on N MindSpore processes with msrun, with a timeout so a hung
collective fails the test. Workers write results as JSON files into `out_dir`."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys

from tests_extend.distributed.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class MsrunError(AssertionError):
    pass


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [l for l in f.read().splitlines() if "WARNING" not in l]
        return "\n".join(lines[-n:])
    except OSError:
        return "(no log)"


def run_msrun(script: str, args: list, out_dir: str, *, workers: int = 2, timeout: float = 240) -> list:
    """Run `script args...` on `workers` msrun processes; return each rank's JSON result
    (out_dir/rank{r}.json, written by the worker)."""
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), GLOG_v="3",
               PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    log_dir = os.path.join(out_dir, "msrun_logs")
    cmd = [os.path.join(bindir, "msrun"), f"--worker_num={workers}", f"--local_worker_num={workers}",
           f"--master_port={free_port()}", "--join=True", f"--log_dir={log_dir}", "--cluster_time_out=120",
           script, *map(str, args)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)      # msrun and the workers it spawned
        proc.communicate()
        raise MsrunError(f"msrun {os.path.basename(script)} timed out after {timeout}s\n"
                         + "\n".join(_tail(p) for p in sorted(glob.glob(os.path.join(log_dir, "worker_*.log")))))
    results = []
    for rank in range(workers):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if proc.returncode != 0 or not os.path.isfile(path):
            logs = "\n".join(f"--- {p}\n{_tail(p)}" for p in sorted(glob.glob(os.path.join(log_dir, "worker_*.log"))))
            raise MsrunError(f"msrun {os.path.basename(script)} failed (rc {proc.returncode}); "
                             f"no result from rank {rank}\n{out[-3000:]}\n{logs}")
        with open(path) as f:
            results.append(json.load(f))
    return results


def write_result(out_dir: str, rank: int, result) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
