"""The MindSpore trainer on CPU with PyNative ops run synchronously (what the backend sets) against
MindSpore's default asynchronous dispatch: wall and CPU time of the same training steps, each in a
fresh process, the two modes alternating over the rounds so both see the same machine load.
Prints the medians, their ratios, and whether the losses are identical.

    OMP_NUM_THREADS=1 python tests_extend/benchmarks/bench_mindspore_pynative_sync.py [--steps 20 --rounds 3]

Two runs of mindspore_parity's GPT: the default trainer (forward traced into a graph) and with full
recompute (the trainer runs PyNative, as with pipeline parallelism, MoE or context parallelism).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS = {"graph (traced forward)": (),
        "PyNative (full recompute)": ("--recompute-granularity", "full", "--recompute-method", "uniform",
                                      "--recompute-num-layers", "1")}


def child(mode: str, run: str, steps: int) -> None:
    sys.path.insert(0, ROOT)
    import mindspore as ms
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed import mindspore_parity as mp
    backend = MindSporeBackend("cpu")
    if mode == "async":          # undo the backend's setting: MindSpore's default
        ms.set_context(pynative_synchronize=False)
    wall, cpu = time.perf_counter(), time.process_time()
    result = mp.ms_train(backend, 1, False, None, steps=steps, extra=RUNS[run])
    print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
                      "losses": result["losses"], "graph_mode": result["graph_mode"]}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", nargs=2, metavar=("MODE", "RUN"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child[0], a.child[1], a.steps)
        return 0
    env = dict(os.environ, GLOG_v="3", PYTHONPATH=ROOT)
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}, {a.steps} steps per process, "
          f"{a.rounds} rounds; load average before: {os.getloadavg()[0]:.2f}")
    print("| run | mode | wall (s) | CPU (s) | wall sync/async | CPU sync/async | losses identical |")
    print("|---|---|---|---|---|---|---|")
    for run in RUNS:
        got = {"async": [], "sync": []}
        for _ in range(a.rounds):
            for mode in got:
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--steps", str(a.steps),
                                      "--child", mode, run], env=env, capture_output=True, text=True, check=True)
                got[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
        same = all(r["losses"] == got["async"][0]["losses"] for rs in got.values() for r in rs)
        med = {mode: {k: statistics.median(r[k] for r in rs) for k in ("wall", "cpu")} for mode, rs in got.items()}
        for mode in got:
            ratio = (f"{med['sync']['wall'] / med['async']['wall']:.2f}x | {med['sync']['cpu'] / med['async']['cpu']:.2f}x"
                     if mode == "sync" else " | ")
            print(f"| {run} | {mode} | {med[mode]['wall']:.2f} | {med[mode]['cpu']:.2f} | {ratio} | {same} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
