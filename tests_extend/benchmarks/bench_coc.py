"""--use-ascend-coc benchmark (CPU, torch backend, gloo, TP=2): a tensor-parallel MLP
(Megatron-Core ColumnParallelLinear -> RowParallelLinear) forward + backward, in one run:

- without overlap: Megatron's layers (each collective after its GEMM);
- with overlap: the same layers through CoC, --coc-parallel-num 2 and 4;
- compute alone: the same per-rank GEMMs fwd+bwd with no communication;
- communication alone: the same collectives with the same shapes, back to back, no GEMM;
- ideal = max(compute, communication); each time's ratio to it (1.0 = perfect overlap).

Per configuration: the median of --steps steps on rank 0 after a warm-up, a barrier before each
step, the configurations taking turns step by step (the load drifts less between them). One thread per process (so the two ranks use the machine's two cores). The load average is
printed with the figures: the machine is shared.

    python tests_extend/benchmarks/bench_coc.py [--seq 4096] [--hidden 1024] [--ffn 256] [--steps 10]
    python tests_extend/benchmarks/bench_coc.py --backend mindspore   # msrun, bench_coc_mindspore.py

The default shapes keep communication and compute of the same order (a thin FFN), where overlap
has something to win.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests_extend.distributed.harness import run_distributed  # noqa: E402


def _timed_interleaved(fns, steps):
    """Median per function, the functions taking turns step by step (a busy machine's load
    drifts: interleaving gives every configuration the same share of it)."""
    import torch.distributed as dist
    times = {k: [] for k in fns}
    for i in range(steps + 1):
        for name, fn in fns.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            if i:                                 # step 0 warms up
                times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def _body(rank, world_size, seq, hidden, ffn, steps):
    import torch
    import torch.distributed as dist

    import mindspeed
    from mindspeed.features.parallel.coc import Coc
    from mindspeed.flags.trainer_flags import parse_args
    torch.set_num_threads(1)
    rows, part = seq // 2, ffn // 2
    results = {}
    for sp in (True, False):
        # Megatron's layers, unpatched (no --use-ascend-coc); the CoC runs call the same algorithm
        # the hook installs (Coc.column_linear / row_linear) on the same weights and group
        session = mindspeed.adapt(parse_args(["--tensor-model-parallel-size", "2", "--mock-data"]
                                             + (["--sequence-parallel"] if sp else [])))
        coc = Coc(session.backend)
        try:
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
            from megatron.core.transformer.transformer_config import TransformerConfig

            from tests_extend.megatron_tiny import init_parallel
            init_parallel(tp=2)
            cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4,
                                    use_cpu_initialization=True, tensor_model_parallel_size=2, sequence_parallel=sp)
            col = ColumnParallelLinear(hidden, ffn, config=cfg, init_method=torch.nn.init.normal_,
                                       bias=False, gather_output=False)
            row = RowParallelLinear(ffn, hidden, config=cfg, init_method=torch.nn.init.normal_,
                                    bias=False, input_is_parallel=True, skip_bias_add=True)
            group = parallel_state.get_tensor_model_parallel_group()
            x = torch.randn(rows if sp else seq, 1, hidden, requires_grad=True)

            def megatron():
                y, _ = row(col(x)[0])
                y.backward(torch.ones_like(y))

            def overlapped(chunks):
                def step():
                    h = coc.column_linear(x, col.weight, group, sequence_parallel=sp, chunks=chunks)
                    y = coc.row_linear(h, row.weight, group, sequence_parallel=sp, chunks=chunks)
                    y.backward(torch.ones_like(y))
                return step
            # compute alone: this rank's GEMMs, fwd + bwd, no collective
            xf = torch.randn(seq, 1, hidden, requires_grad=True)
            w1 = torch.randn(part, hidden, requires_grad=True)
            w2 = torch.randn(hidden, part, requires_grad=True)

            def compute():
                y = torch.nn.functional.linear(torch.nn.functional.linear(xf, w1), w2)
                y.backward(torch.ones_like(y))
            # communication alone: the same collectives as the non-overlapped layers
            local, full = torch.randn(rows, 1, hidden), torch.randn(seq, 1, hidden)
            parts = [torch.empty_like(local) for _ in range(2)]

            def communicate():
                if sp:   # fwd: gather x, reduce-scatter y; bwd: gather dy, gather x (wgrad), reduce-scatter dx
                    for _ in range(3):
                        dist.all_gather(parts, local, group=group)
                    for _ in range(2):
                        dist.reduce_scatter(local, list(full.chunk(2)), group=group)
                else:    # fwd: all-reduce y; bwd: all-reduce dx
                    for _ in range(2):
                        dist.all_reduce(full.clone(), group=group)
            timed = _timed_interleaved({"compute alone": compute, "communication alone": communicate,
                                        "no overlap": megatron, "coc 2 chunks": overlapped(2),
                                        "coc 4 chunks": overlapped(4)}, steps)
            results.update({(sp, k): v for k, v in timed.items()})
        finally:
            mindspeed.unadapt()
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", choices=("torch", "mindspore"), default="torch")
    args = parser.parse_args(argv)
    if args.backend == "mindspore":
        return main_mindspore(args)
    load_before = os.getloadavg()
    res = run_distributed(_body, world_size=2, args=(args.seq, args.hidden, args.ffn, args.steps),
                          timeout=1800)[0]
    print(f"TP=2 MLP fwd+bwd, seq {args.seq} hidden {args.hidden} ffn {args.ffn}, fp32, gloo, 1 thread per rank; "
          f"median of {args.steps} steps (ms)")
    for sp in (True, False):
        ideal = max(res[(sp, "compute alone")], res[(sp, "communication alone")])
        print(f"\n{'sequence parallel' if sp else 'all-reduce (no SP)'}:")
        for label in ("compute alone", "communication alone", "no overlap", "coc 2 chunks", "coc 4 chunks"):
            t = res[(sp, label)]
            print(f"  {label:22s} {t * 1e3:9.1f}   x ideal {t / ideal:5.2f}")
        print(f"  {'ideal max(comp, comm)':22s} {ideal * 1e3:9.1f}")
    print(f"\nload average before {tuple(round(v, 2) for v in load_before)}, "
          f"after {tuple(round(v, 2) for v in os.getloadavg())} (2 cores)")


MS_ROWS = ("no overlap, traced", "no overlap, PyNative", "coc 2 chunks", "coc 4 chunks", "compute alone",
           "communication alone", "probe: all-reduce then GEMMs", "probe: all-reduce async under GEMMs")


def main_mindspore(args):
    """The MindSpore trainer's TP=2 layers, plain and through CoC (bench_coc_mindspore.py on msrun)."""
    import tempfile

    from tests_extend.distributed.msrun_helper import run_msrun
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_coc_mindspore.py")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as out:
        res = run_msrun(worker, [out, args.seq, args.hidden, args.ffn, args.steps], out, timeout=1800)[0]
    print(f"MindSpore TP=2 MLP fwd+bwd, seq {args.seq} hidden {args.hidden} ffn {args.ffn}, fp32, msrun on CPU; "
          f"median of {args.steps} steps (ms)")
    for sp in (True, False):
        base = res[f"{sp}/no overlap, PyNative"]
        print(f"\n{'sequence parallel' if sp else 'all-reduce (no SP)'}:   (x: ratio to no overlap, PyNative)")
        for label in MS_ROWS:
            t = res[f"{sp}/{label}"]
            print(f"  {label:36s} {t * 1e3:9.1f}   x {t / base:5.2f}")
        probe = res[f"{sp}/probe: all-reduce async under GEMMs"] / res[f"{sp}/probe: all-reduce then GEMMs"]
        print(f"  async probe: overlapped / sequential = {probe:.2f} (below 1: the async all-reduce ran under the GEMMs)")
    print(f"\nload average before {tuple(round(v, 2) for v in load_before)}, "
          f"after {tuple(round(v, 2) for v in os.getloadavg())} (2 cores)")


if __name__ == "__main__":
    main()
