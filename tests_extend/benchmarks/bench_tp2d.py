"""--tp-2d benchmark: communication volume per training step per rank, 2-D TP against 1-D TP at the
same TP size (4 gloo processes, the built-in torch trainer, Megatron-Core's GPT, fp32).

Every torch.distributed collective a rank calls is recorded (op, group size, bytes of its tensors), and
turned into the bytes the rank sends under the usual algorithms (ring all-reduce 2(n-1)/n S, all-gather
(n-1) S_in, reduce-scatter and all-to-all (n-1)/n S_in, broadcast S). A step's volume is the difference
between a run of --steps + 2 and one of 2 steps, divided by --steps (the build's and the first steps'
one-off collectives cancel). Layouts: plain TP, plain TP with --sequence-parallel, and each 2-D grid.
Volume, not time: 4 processes on this machine's cores measure contention, not the network.

    python tests_extend/benchmarks/bench_tp2d.py [--hidden 256] [--seq 256] [--layers 2] [--steps 2]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests_extend.distributed.harness import next_rendezvous, run_distributed  # noqa: E402

LAYOUTS = {"1-D TP 4": ["--tensor-model-parallel-size", "4"],
           "1-D TP 4 + SP": ["--tensor-model-parallel-size", "4", "--sequence-parallel"],
           "2-D 2 x 2": ["--tensor-model-parallel-size", "4", "--tp-2d", "--tp-x", "2", "--tp-y", "2"],
           "2-D 4 x 1": ["--tensor-model-parallel-size", "4", "--tp-2d", "--tp-x", "4", "--tp-y", "1"],
           "2-D 1 x 4": ["--tensor-model-parallel-size", "4", "--tp-2d", "--tp-x", "1", "--tp-y", "4"]}


def _nbytes(t):
    return t.numel() * t.element_size()


def _sent(op, n, args):
    """Bytes this rank sends for one call (the ring / pairwise algorithms' count)."""
    first = args[0]
    if op == "all_reduce":
        return 2 * (n - 1) / n * _nbytes(first)
    if op == "all_gather":                       # (outputs list, input)
        return (n - 1) * _nbytes(args[1])
    if op == "all_gather_into_tensor":           # (output, input)
        return (n - 1) * _nbytes(args[1])
    if op == "reduce_scatter":                   # (output, inputs list)
        return (n - 1) / n * sum(_nbytes(t) for t in args[1])
    if op == "reduce_scatter_tensor":            # (output, input)
        return (n - 1) / n * _nbytes(args[1])
    if op == "all_to_all":                       # (outputs list, inputs list)
        return (n - 1) / n * sum(_nbytes(t) for t in args[1])
    if op == "all_to_all_single":
        return (n - 1) / n * _nbytes(args[1])
    if op == "broadcast":
        return _nbytes(first)
    return 0


def _record(log):
    """Wrap torch.distributed's collectives (and the ones Megatron's modules bound to names at import) so each call adds its bytes to `log` (op -> [bytes sent, calls]); returns the undo."""
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.tensor_parallel import layers, mappings
    targets = [(dist, op, op) for op in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                                         "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast")]
    targets += [(module, name, op) for module in (mappings, layers, param_and_grad_buffer)
                for name, op in (("dist_all_gather_func", "all_gather_into_tensor"),
                                 ("dist_reduce_scatter_func", "reduce_scatter_tensor"))]
    originals = []
    for owner, attr, op in targets:
        original = getattr(owner, attr)
        originals.append((owner, attr, original))

        def counted(*args, _op=op, _original=original, **kwargs):
            n = dist.get_world_size(kwargs.get("group"))
            if n > 1:
                log[_op][0] += _sent(_op, n, args)
                log[_op][1] += 1
            return _original(*args, **kwargs)
        setattr(owner, attr, counted)
    return lambda: [setattr(owner, attr, fn) for owner, attr, fn in originals]


def _body(rank, world_size, model, steps, tmp):
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.pretrain import run
    out = {}
    for name, flags in LAYOUTS.items():
        volume = {}
        for iters in (2, steps + 2):
            log = collections.defaultdict(lambda: [0.0, 0])
            marker = os.path.join(tmp, f"{name}-{iters}".replace(" ", "_"))
            next_rendezvous(rank, marker + ".port")
            args = parse_args(model + flags + ["--train-iters", str(iters), "--log-loss-file", marker + ".jsonl"])
            session = mindspeed.adapt(args)
            restore = _record(log)
            try:
                run(args, session)
            finally:
                restore()
                mindspeed.unadapt()
            volume[iters] = {op: tuple(v) for op, v in log.items()}
        out[name] = {op: ((volume[steps + 2][op][0] - volume[2].get(op, (0, 0))[0]) / steps,
                          (volume[steps + 2][op][1] - volume[2].get(op, (0, 0))[1]) / steps)
                     for op in volume[steps + 2]}
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args()
    model = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "8",
             "--ffn-hidden-size", str(4 * a.hidden), "--seq-length", str(a.seq), "--max-position-embeddings",
             str(a.seq), "--micro-batch-size", "1", "--global-batch-size", "1", "--eval-iters", "0",
             "--eval-interval", "1000", "--log-interval", "1000", "--lr", "1e-4", "--mock-data", "--seed", "1",
             "--hidden-dropout", "0", "--attention-dropout", "0"]
    with tempfile.TemporaryDirectory() as tmp:
        res = run_distributed(_body, world_size=4, args=(model, a.steps, tmp), timeout=1800)
    load = os.getloadavg()
    print(f"tp-2d communication volume per step per rank (load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
          f"hidden {a.hidden}, seq {a.seq}, {a.layers} layers, micro-batch 1, fp32)")
    base = sum(v[0] for v in res[0]["1-D TP 4"].values())
    for name in LAYOUTS:
        per_rank = [sum(v[0] for v in r[name].values()) for r in res]
        ops = ", ".join(f"{op} {v[0] / 2**20:.2f} MiB ({v[1]:.0f} calls)" for op, v in sorted(res[0][name].items()))
        print(f"  {name:14s} {max(per_rank) / 2**20:8.2f} MiB sent (max over ranks)  ratio to 1-D TP "
              f"{max(per_rank) / base:.3f}   rank 0: {ops}")
    print(json.dumps({name: max(sum(v[0] for v in r[name].values()) for r in res) for name in LAYOUTS}))


if __name__ == "__main__":
    main()
