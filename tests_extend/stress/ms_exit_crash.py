"""Reproducer for MindSpore's crash at exit (docs/native-crash.md), with no MindSpeed code in the workers.

Each msrun worker joins the cluster (`mindspore.communication.init()`), runs a few CPU ops, optionally
pins itself and every thread to one core (as MindSpeed's MINDSPEED_MS_CPU_AFFINITY=1 did), and ends
as Python ends: MindSpore's atexit handler finalizes the cluster node and clears its runtime.

    python tests_extend/stress/ms_exit_crash.py --launches 30 --workers 2 --pin

Not a pytest test. Each launch prints its exit code and verdict; a crashed launch's logs are kept.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from ms_native_crash import NATIVE_CRASH_SIGNS, ROOT       # this script's folder is on sys.path

# the exit crash's other form: std::system_error thrown out of the handler
CRASH_SIGNS = (*NATIVE_CRASH_SIGNS, "terminate called")


def worker(args) -> None:
    import numpy as np
    import mindspore as ms
    from mindspore import ops
    from mindspore.communication import init, get_rank
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init()
    if args.pin:
        core = {sorted(os.sched_getaffinity(0))[get_rank() % len(os.sched_getaffinity(0))]}
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), core)
            except OSError:
                pass
    w = ms.Tensor(np.random.rand(64, 64).astype(np.float32))
    x = ms.Tensor(np.random.rand(8, 64).astype(np.float32))
    for _ in range(args.steps):
        x = ops.tanh(ops.matmul(x, w))
    print(f"rank {get_rank()} done {float(x.sum()):.3f}", flush=True)


def launches(args) -> int:
    sys.path.insert(0, ROOT)
    from mindspeed.net import free_port
    bindir = os.path.dirname(sys.executable)       # msrun starts `python` from PATH
    env = dict(os.environ, PYTHONFAULTHANDLER="1", GLOG_v="3", PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    if args.perturb != "0":
        env.update(MALLOC_CHECK_="3", MALLOC_PERTURB_=args.perturb)
    inner = [os.path.abspath(__file__), "--as-worker", "--steps", str(args.steps),
             *(["--pin"] if args.pin else [])]
    crashes = 0
    for k in range(args.launches):
        log_dir = tempfile.mkdtemp(prefix="ms_exit_")
        cmd = [os.path.join(bindir, "msrun"), f"--worker_num={args.workers}", f"--local_worker_num={args.workers}",
               f"--master_port={free_port()}", "--join=True", f"--log_dir={log_dir}", "--cluster_time_out=60", *inner]
        started = time.time()
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        logs = p.stdout + "".join(open(os.path.join(log_dir, f), errors="replace").read()
                                  for f in sorted(os.listdir(log_dir)))
        crashed = any(s in logs for s in CRASH_SIGNS)
        crashes += crashed
        print(f"launch {k + 1}/{args.launches}: rc {p.returncode} {time.time() - started:.0f}s "
              f"{'CRASH' if crashed else 'FAILED' if p.returncode else 'ok'}", flush=True)
        if crashed or p.returncode:
            keep = os.path.join(args.keep, f"exit_crash_{os.getpid()}_{k + 1}.log")
            with open(keep, "w") as f:
                f.write(logs)
            print(f"  log kept: {keep}", flush=True)
        shutil.rmtree(log_dir, ignore_errors=True)
    print(f"crashes: {crashes}/{args.launches} launches; workers {args.workers}, "
          f"pin {args.pin}, MALLOC_PERTURB_ {args.perturb}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--launches", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pin", action="store_true", help="pin each worker and its threads to one core")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--perturb", default="165", help="MALLOC_PERTURB_ (0: glibc's checks off)")
    p.add_argument("--keep", default=tempfile.gettempdir())
    args = p.parse_args()
    if args.as_worker:
        worker(args)
        return 0
    return launches(args)


if __name__ == "__main__":
    sys.exit(main())
