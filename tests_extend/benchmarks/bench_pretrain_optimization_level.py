"""Throughput of the example (train_distributed.sh, 2 processes) at --optimization-level 0
(Megatron-Core's own unfused paths) vs 2 (MindSpeed's fused kernels), measured in one run with
the levels interleaved so machine load hits both alike.

    python tests_extend/benchmarks/bench_pretrain_optimization_level.py [--iters 300] [--rounds 1]

Prints tokens/s per level and the ratio level2/level0. Extra arguments after `--` go to the
example (e.g. `-- --num-layers 2`); environment overrides (TP, PP, ...) apply as usual.
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
DONE = re.compile(r"> done: \d+ iterations \| final validation loss (\S+).*throughput (\d+) tokens/s")


def _port() -> str:
    sys.path.insert(0, ROOT)
    from mindspeed.net import free_port
    return str(free_port())


def run_once(level: int, iters: int, extra: list[str]) -> tuple[float, str]:
    # everything else at the example's defaults (throughput counts training steps only)
    env = dict(os.environ, PYTHON=sys.executable, OPTIMIZATION_LEVEL=str(level), TRAIN_ITERS=str(iters),
               MASTER_PORT=_port())
    out = subprocess.run(["bash", SCRIPT, *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1800)
    match = DONE.search(out.stdout + out.stderr)
    if out.returncode != 0 or match is None:
        raise SystemExit(f"level {level} run failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return float(match.group(2)), match.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300, help="training iterations (example default)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    results: dict[int, list[float]] = {0: [], 2: []}
    load_start = os.getloadavg()[0]
    for r in range(args.rounds):
        for level in (0, 2) if r % 2 == 0 else (2, 0):
            tps, loss = run_once(level, args.iters, args.extra)
            results[level].append(tps)
            print(f"round {r + 1} level {level}: {tps:.0f} tokens/s (final validation loss {loss})", flush=True)
    med = {lvl: statistics.median(v) for lvl, v in results.items()}
    print(f"median tokens/s: level 0 {med[0]:.0f} | level 2 {med[2]:.0f} | "
          f"ratio level2/level0 = {med[2] / med[0]:.2f} | load average {load_start:.1f} -> "
          f"{os.getloadavg()[0]:.1f} (rerun above 1)")


if __name__ == "__main__":
    main()
