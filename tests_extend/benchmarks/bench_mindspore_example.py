"""The README's 2-process example on both trainers, in one run: torchrun TP=2
(tests_extend/example/train_distributed.sh) vs msrun TP=2 (train_distributed_ms.sh), same default
config (4 layers, hidden 128, seq 128, micro-batch 16, global batch 32, fp32, 2 CPU processes).

The jobs take turns (torch, mindspore, mindspore with MCCL, torch, ...) for --rounds rounds of
--iters iterations each, so all see the same machine load. "mindspore with MCCL" is the same job with
MINDSPEED_MS_SHM_COLLECTIVES=0: MindSpore's own CPU collectives instead of the shared-memory ones
(--no-mccl leaves it out). Per trainer: the median of the logged per-iteration times
after the first --skip iterations of each job (MindSpore compiles its graphs in the first ones), and
the wall time of one whole job (start-up, data, compile, --iters iterations, final validation).
Prints the ratios and the load average before and after (shared machine).

    python tests_extend/benchmarks/bench_mindspore_example.py [--iters 12 --skip 3 --rounds 2]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests_extend.distributed.harness import free_port  # noqa: E402

# job -> (launch script, extra environment)
JOBS = {"torch": ("train_distributed.sh", {}), "mindspore": ("train_distributed_ms.sh", {}),
        "mindspore_mccl": ("train_distributed_ms.sh", {"MINDSPEED_MS_SHM_COLLECTIVES": "0"})}
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")


def run_job(trainer: str, iters: int, log_dir: str) -> tuple[list, float, str]:
    """One launch of the example -> (per-iteration ms by iteration, wall seconds, the log)."""
    bindir = os.path.dirname(sys.executable)
    script, extra = JOBS[trainer]
    env = dict(os.environ, **extra, TRAIN_ITERS=str(iters), LOG_INTERVAL="1", EVAL_INTERVAL=str(10 * iters),
               EVAL_ITERS="1", MASTER_PORT=str(free_port()), LOG_DIR=log_dir,
               PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    os.makedirs(log_dir, exist_ok=True)
    start = time.perf_counter()
    proc = subprocess.run(["bash", os.path.join(ROOT, "tests_extend", "example", script)],
                          env=env, cwd=log_dir, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{trainer} job failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    times = {int(i): float(ms) for i, ms in ITERATION.findall(proc.stdout)}
    if len(times) != iters:
        raise SystemExit(f"{trainer}: {len(times)} iteration lines for {iters} iterations:\n{proc.stdout[-3000:]}")
    return [times[i] for i in sorted(times)], wall, proc.stdout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=12, help="iterations per job")
    p.add_argument("--skip", type=int, default=3, help="first iterations of each job left out of the median")
    p.add_argument("--rounds", type=int, default=2, help="jobs per trainer, taking turns")
    p.add_argument("--no-mccl", action="store_true", help="leave out the mindspore job with MCCL collectives")
    a = p.parse_args(argv)
    load_before = os.getloadavg()
    jobs = [name for name in JOBS if not (a.no_mccl and name == "mindspore_mccl")]
    steps = {name: [] for name in jobs}
    walls = {name: [] for name in jobs}
    mode = "?"
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name in jobs:
                times, wall, log = run_job(name, a.iters, os.path.join(tmp, f"{name}{r}"))
                steps[name] += times[a.skip:]
                walls[name].append(wall)
                if name == "mindspore":
                    mode = "graph" if "graph (traced forward)" in log else "PyNative"
    t, m = statistics.median(steps["torch"]), statistics.median(steps["mindspore"])
    tw, mw = statistics.median(walls["torch"]), statistics.median(walls["mindspore"])
    print(f"config: the example's defaults (TP=2, 2 processes, 4 layers, hidden 128, seq 128, micro-batch 16, "
          f"global batch 32), {a.rounds} job(s) of {a.iters} iterations per trainer, median after the first {a.skip}; "
          f"load avg {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("| trainer | median step (ms) | one job, wall (s) |")
    print("|---|---|---|")
    print(f"| torch (torchrun, Megatron-Core) | {t:.0f} | {tw:.1f} |")
    print(f"| mindspore (msrun, {mode}, shared-memory collectives) | {m:.0f} | {mw:.1f} |")
    if "mindspore_mccl" in jobs:
        mc, mcw = statistics.median(steps["mindspore_mccl"]), statistics.median(walls["mindspore_mccl"])
        print(f"| mindspore (msrun, {mode}, MCCL collectives) | {mc:.0f} | {mcw:.1f} |")
    print(f"step time ratio mindspore / torch: {m / t:.2f}x; job wall time ratio: {mw / tw:.2f}x")
    if "mindspore_mccl" in jobs:
        print(f"with MCCL: step time ratio {mc / t:.2f}x; shared memory / MCCL step time: {m / mc:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
