"""--adaptive-recompute-device-size on Megatron-Core (torch backend) against the plain run and
Megatron's full recompute (--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1) in one process: bytes held for backward (the memory meter, whole model),
the step's CPU time (this process, all its threads) after the profiled steps, whether each fits the budget and whether the losses are
bitwise those of the plain run.

    python tests_extend/benchmarks/bench_adaptive_recompute.py [--layers 8 --hidden 512 --seq 512]
        [--budget-fraction 0.5] [--steps 6 --profiled 2] [--rounds 2]

The budget is --budget-fraction of the plain run's layer activations (the adaptive run's own
profile), in whole MB. Runs alternate over --rounds so machine load hits all alike. Step time is in
CPU seconds of this process (other processes' load inflates it less than wall time), over the steps
after the profiled ones of every round: the least (the step disturbed least) and the median. The
load average is printed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests_extend.benchmarks.bench_memory import batch, build, init_one_process, mib, sgd_step  # noqa: E402  (after the path)

MB = 1 << 20
FULL = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")


def measure(flags, opts) -> dict:
    """opts.steps SGD steps with `flags` applied, stepped as the trainer steps (the events)."""
    import torch
    import mindspeed
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from mindspeed.features.base import TRAIN_STEP_BEGIN, TRAIN_STEP_END
    mindspeed.unadapt()
    session = mindspeed.adapt(list(flags))
    model_parallel_cuda_manual_seed(123)
    cfg = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if "full" in flags else {}
    model = build(opts, cfg)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    losses, times, saved = [], [], 0
    for step in range(opts.steps):
        session.publish(TRAIN_STEP_BEGIN, iteration=step + 1)
        # CPU seconds: other processes' load counts less than in wall time
        loss, saved, seconds = sgd_step(model, params, opt, batch(opts, step), clock=time.process_time)
        times.append(seconds)
        losses.append(loss)
        session.publish(TRAIN_STEP_END, iteration=step + 1)
    controller = session.context.part("adaptive_recompute")
    mindspeed.unadapt()
    return dict(saved=saved, losses=losses, times=times[opts.profiled:],
                controller=controller)


def layer_bytes(opts) -> tuple[int, int]:
    """The plain run's layer activations (the profile) and everything else the meter counts."""
    run = measure(("--adaptive-recompute-device-size", str(1 << 30), "--adaptive-recompute-profiling-step", "1"),
                  opts.__class__(**{**vars(opts), "steps": 2, "profiled": 1}))
    layers = sum(p.held_bytes for p in run["controller"].profiles)
    return layers, run["saved"] - layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("layers", 8), ("hidden", 512), ("heads", 8), ("seq", 512), ("vocab", 1024),
                          ("micro-batch", 1), ("steps", 6), ("profiled", 2), ("rounds", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--budget-fraction", type=float, default=0.5)
    opts = parser.parse_args()
    init_one_process()
    layers, outside = layer_bytes(opts)
    budget_mb = max(1, int(layers * opts.budget_fraction / MB))
    print(f"model: {opts.layers} layers, hidden {opts.hidden}, heads {opts.heads}, seq {opts.seq}, micro-batch "
          f"{opts.micro_batch}, fp32, torch/cpu; {opts.steps} steps per run ({opts.profiled} profiled), {opts.rounds} "
          f"rounds; layer activations {mib(layers)} MiB + {mib(outside)} MiB outside the layers; budget {budget_mb} MB "
          f"for the layers; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    runs = {"plain": (), "full recompute": FULL,
            "adaptive": ("--adaptive-recompute-device-size", str(budget_mb),
                         "--adaptive-recompute-profiling-step", str(opts.profiled))}
    results = {name: [] for name in runs}
    for _ in range(opts.rounds):
        for name, flags in runs.items():
            results[name].append(measure(flags, opts))
    report(results, outside, budget_mb, opts)
    print(f"load average at end {os.getloadavg()[0]:.1f}")


def report(results, outside, budget_mb, opts) -> None:
    plain = results["plain"][0]
    print("| run | held for backward (MiB) | layers' part (MiB) | fits the budget | layers recomputed | "
          "CPU s per step (least / median) | vs full recompute (least / median) | losses bitwise |")
    print("|---|---|---|---|---|---|---|---|")
    full = _step_seconds(results["full recompute"])
    for name, runs in results.items():
        run, (least, median) = runs[0], _step_seconds(runs)
        plan = run["controller"].plan if run["controller"] else None
        recomputed = (f"{len(plan.recompute)} of {opts.layers}" if plan else
                      f"{opts.layers} of {opts.layers}" if name == "full recompute" else "0")
        part = run["saved"] - outside
        print(f"| {name} | {mib(run['saved'])} | {mib(part)} | {'yes' if part <= budget_mb * MB else 'NO'} | "
              f"{recomputed} | {least:.3f} / {median:.3f} | {least / full[0]:.2f} / {median / full[1]:.2f} | "
              f"{'yes' if all(r['losses'] == plain['losses'] for r in runs) else 'NO'} |", flush=True)


def _step_seconds(runs) -> tuple[float, float]:
    """The least and the median CPU seconds per step over every measured step of `runs`: the least is
    the step other processes disturbed least."""
    times = [t for r in runs for t in r["times"]]
    return min(times), statistics.median(times)


if __name__ == "__main__":
    main()
