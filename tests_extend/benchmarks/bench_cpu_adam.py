"""torch's AdamW step on the cpu: the single-tensor path Megatron-Core gets by default, foreach, and
the fused kernel the torch backend switches Megatron's Adam to (backends/torch/fused_cpu_adam.py).

    python tests_extend/benchmarks/bench_cpu_adam.py [--rounds 3] [--steps 60] [--threads 1]

The parameters are those of bench_plain_gpt.py's GPT-2 layout (4 layers, hidden 128: 52 tensors,
0.82 M values), in two groups as Megatron's (weight decay on matrices only), with random gradients.
Each round steps each path in turn; a path's figure is the median over rounds of its median step
time after 10 warm-up steps. Prints the load average before and after: rerun when it is above 1.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

PATHS = {"single-tensor": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def adamw_on_gpt2_params(**options):
    """torch's AdamW over the GPT-2 layout's parameters in Megatron's two groups, random gradients set."""
    import torch
    from tests_extend.benchmarks import bench_plain_gpt as plain
    torch.manual_seed(0)
    model = plain.build_plain(dict(plain.MODEL, **plain.SIZES["issue"], layout="gpt2"))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    groups = [dict(params=[p for p in params if p.dim() > 1], weight_decay=0.1),
              dict(params=[p for p in params if p.dim() <= 1], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=3e-4, **options)


def median_step_ms(optimizer, steps: int) -> float:
    """The median of `steps` optimizer steps after 10 warm-up ones."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[10:])


def step_ms(options: dict, steps: int) -> float:
    return median_step_ms(adamw_on_gpt2_params(**options), steps)


def arguments(argv, description: str):
    """--rounds, --steps, --threads (torch set to them)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    if a.steps <= 10:
        p.error("--steps must be above 10 (the first 10 are warm-up)")
    import torch
    torch.set_num_threads(a.threads)
    return a


def main(argv=None) -> int:
    a = arguments(argv, __doc__.split("\n")[0])
    load = lambda: " ".join(f"{x:.2f}" for x in os.getloadavg())   # noqa: E731
    print(f"AdamW step, GPT-2 layout parameters, {a.threads} thread(s), {a.rounds} round(s); load average {load()}")
    ms = {name: [] for name in PATHS}
    for _ in range(a.rounds):
        for name, options in PATHS.items():
            ms[name].append(step_ms(options, a.steps))
    single = statistics.median(ms["single-tensor"])
    for name in PATHS:
        value = statistics.median(ms[name])
        print(f"{name:14s} {value:7.3f} ms  {value / single:6.3f}x the single-tensor path")
    print(f"load average: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
