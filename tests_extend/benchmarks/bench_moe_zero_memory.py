"""--moe-zero-memory benchmark (CPU, torch backend, gloo, 2 processes, EP 2, alltoall dispatcher):
one Megatron-Core MoE layer under --moe-alltoall-overlap-comm, with --moe-zero-memory off, level0
and level1, in one run:

- activation bytes the layer holds for backward (saved-tensor hooks, unique storages, sized after
  the forward: memory a recompute freed counts 0), rank 0, weights excluded;
- fwd+bwd step time, the configurations interleaved step by step (bench_moe_comm's timing), median
  of --steps steps after a warm-up, one thread per rank; the load average is printed.

    python tests_extend/benchmarks/bench_moe_zero_memory.py [--tokens 4096] [--hidden 512] [--ffn 512]
                                                            [--experts 8] [--steps 8]
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests_extend.benchmarks.bench_moe_comm import _flags, _interleaved, _layer, run_sized  # noqa: E402

OVERLAP = ["--moe-alltoall-overlap-comm"]
CONFIGS = {"overlap": OVERLAP, "overlap + zero-memory level0": OVERLAP + ["--moe-zero-memory", "level0"],
           "overlap + zero-memory level1": OVERLAP + ["--moe-zero-memory", "level1"]}


def _saved_bytes(step_layer, flags) -> int:
    """Bytes the layer's forward keeps for backward under `flags` (then its backward, so both ranks finish)."""
    import mindspeed
    from tests_extend.memory_meter import saved_for_backward
    layer, x = step_layer
    mindspeed.adapt(flags)
    try:
        with saved_for_backward() as meter:
            y, _ = layer(x)
        saved = meter.nbytes(exclude=list(layer.parameters()))
        y.backward(y.detach())
    finally:
        mindspeed.unadapt()
    return saved


def _body(rank, world_size, tokens, hidden, ffn, experts, steps):
    import torch
    from megatron.core import parallel_state as ps

    import mindspeed
    from mindspeed.features.moe import zero_memory_megatron
    torch.set_num_threads(1)
    torch.manual_seed(0)
    flags = {k: _flags(f, 1, 2, "alltoall", experts) for k, f in CONFIGS.items()}
    mindspeed.adapt(flags["overlap"])                      # the device shim for building
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    step = _layer(1, 2, "alltoall", tokens, hidden, ffn, experts)
    mindspeed.unadapt()
    closed = dict(zip(step.__code__.co_freevars, (c.cell_contents for c in step.__closure__)))
    layer_and_input = (closed["layer"], closed["x"])      # the layer and input bench_moe_comm's step runs
    saved = {k: _saved_bytes(layer_and_input, f) for k, f in flags.items()}
    zero_memory_megatron.reset_counts()
    times = _interleaved({k: step for k in CONFIGS}, flags, steps)
    return dict(saved=saved, times=times, recomputes=dict(zero_memory_megatron.COUNTS))


def main(argv=None):
    res, args, load_before = run_sized(_body, __doc__.splitlines()[0], argv)
    print(f"MoE layer fwd+bwd, EP 2 alltoall + --moe-alltoall-overlap-comm, {args.tokens} tokens per rank, hidden "
          f"{args.hidden}, expert ffn {args.ffn} (SwiGLU), {args.experts} experts top-2, fp32, gloo, 1 thread per rank")
    base_saved, base_time = res["saved"]["overlap"], res["times"]["overlap"]
    print(f"  {'configuration':30s} {'saved for backward MiB':>22s} {'x overlap':>9s} {'step ms':>9s} {'x overlap':>9s}")
    for name in CONFIGS:
        s, t = res["saved"][name], res["times"][name]
        print(f"  {name:30s} {s / 2**20:22.1f} {s / base_saved:9.2f} {t * 1e3:9.1f} {t / base_time:9.2f}")
    print(f"  (recomputes in the timed steps, rank 0: {res['recomputes']['recomputed']}, of them under a gradient "
          f"all-to-all in flight: {res['recomputes']['under_comm']})")
    print(f"load average before {tuple(round(v, 2) for v in load_before)}, "
          f"after {tuple(round(v, 2) for v in os.getloadavg())} (2 cores)")


if __name__ == "__main__":
    main()
