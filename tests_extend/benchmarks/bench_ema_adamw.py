"""--optimizer-selection fused_ema_adamw against plain Adam on the cpu: optimizer-state bytes per
parameter and the optimizer step's time, in one run.

    python tests_extend/benchmarks/bench_ema_adamw.py [--rounds 3] [--steps 60] [--threads 1]

The parameters are those of bench_plain_gpt.py's GPT-2 layout (4 layers, hidden 128: 52 tensors,
0.82 M values), in two groups as Megatron's (weight decay on matrices only), with random gradients;
both paths step torch's fused AdamW (the kernel the torch backend gives Megatron's Adam on the cpu);
the EMA path also runs the feature's own step hooks (ema_adamw_megatron.EmaOfWeights). Each round
steps each path in turn; a path's figure is the median over rounds of its median step time after 10
warm-up steps. Prints the load average before and after: rerun when it is above 1.
"""
from __future__ import annotations

import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests_extend.benchmarks.bench_cpu_adam import adamw_on_gpt2_params, arguments, median_step_ms  # noqa: E402


def run(ema: bool, steps: int) -> tuple[float, float]:
    """(median step ms, optimizer-state bytes per parameter) of one path."""
    import torch
    from mindspeed.features.training.ema_adamw_megatron import EmaOfWeights
    optimizer = adamw_on_gpt2_params(fused=True)
    if ema:
        EmaOfWeights(optimizer, 0.9999)
    ms = median_step_ms(optimizer, steps)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                      if torch.is_tensor(t) and t.numel() > 1)
    return ms, state_bytes / sum(p.numel() for p in params)


def main(argv=None) -> int:
    a = arguments(argv, __doc__.split("\n")[0])
    load = lambda: " ".join(f"{x:.2f}" for x in os.getloadavg())   # noqa: E731
    print(f"optimizer step, GPT-2 layout parameters, {a.threads} thread(s), {a.rounds} round(s); "
          f"load average {load()}")
    ms, per_param = {"adam": [], "fused_ema_adamw": []}, {}
    for _ in range(a.rounds):
        for name in ms:
            step, per_param[name] = run(name != "adam", a.steps)
            ms[name].append(step)
    adam = statistics.median(ms["adam"])
    for name in ms:
        value = statistics.median(ms[name])
        print(f"{name:16s} {value:7.3f} ms/step ({value / adam:5.3f}x adam)  optimizer state "
              f"{per_param[name]:4.1f} bytes/parameter ({per_param[name] / per_param['adam']:4.2f}x adam)")
    print(f"load average: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
