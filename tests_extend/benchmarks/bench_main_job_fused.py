"""Main job (tests_extend/example/train_distributed.sh, default config) with MindSpeed's fused
kernels (optimization level 2, FUSED=1) vs --optimization-level 0 (Megatron-Core's own paths).
Runs both back to back and prints the steady-state tokens/s of each and their ratio.

    python tests_extend/benchmarks/bench_main_job_fused.py [--iters 60] [--seq 128] [--rounds 1]
Extra KEY=VALUE arguments override the script's environment settings (e.g. SEQ_LENGTH=512).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests_extend", "example", "train_distributed.sh")
TOKENS = re.compile(r"iteration\s+(\d+)/.*tokens per second: (\d+)")


def run(level: int, iters: int, log_interval: int, overrides: dict, port: int) -> list[float]:
    env = dict(os.environ, TRAIN_ITERS=str(iters), LOG_INTERVAL=str(log_interval), EVAL_INTERVAL=str(10 * iters),
               EVAL_ITERS="1", OPTIMIZATION_LEVEL=str(level), FUSED="1", MASTER_PORT=str(port),
               PYTHON=sys.executable, **overrides)
    proc = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"level {level} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rates = [(int(it), float(tps)) for it, tps in TOKENS.findall(proc.stdout)]
    return [tps for it, tps in rates if it > log_interval]     # drop the first interval (warm-up, JIT build)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="alternate fused/unfused runs this many times")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE settings of train_distributed.sh")
    args = parser.parse_args()
    overrides = dict(kv.split("=", 1) for kv in args.overrides)
    fused, plain, per_round, ratios = [], [], [], []
    for r in range(args.rounds):   # alternate, so slow drift in machine load hits both alike
        f_r = run(2, args.iters, args.log_interval, overrides, 29500 + 2 * r)
        p_r = run(0, args.iters, args.log_interval, overrides, 29501 + 2 * r)
        fused, plain = fused + f_r, plain + p_r
        ratios.append(statistics.median(f_r) / statistics.median(p_r))
        per_round.append(f"round {r + 1}: fused {statistics.median(f_r):.0f}, level 0 {statistics.median(p_r):.0f} "
                         f"({ratios[-1]:.2f}x)")
    f, p = statistics.median(fused), statistics.median(plain)
    print(f"main job {overrides or 'default config'}, {args.iters} iterations x {args.rounds} round(s), "
          "median tokens/s after the first log interval (all rounds pooled):")
    print("| run | tokens/s |")
    print("|---|---|")
    print(f"| fused (optimization level 2: --use-fused-rmsnorm/swiglu/rotary-pos-emb, --use-flash-attn) | {f:.0f} |")
    print(f"| --optimization-level 0 (Megatron-Core paths) | {p:.0f} |")
    # each round's pair ran back to back under the same machine load: their ratio is the measurement
    print(f"| ratio fused / level 0 (geometric mean of per-round ratios) | "
          f"{statistics.geometric_mean(ratios):.2f}x |")
    print("; ".join(per_round))


if __name__ == "__main__":
    main()
