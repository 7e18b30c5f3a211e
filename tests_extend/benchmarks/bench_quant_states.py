"""Optimizer-state bytes per parameter with --quant-states fp8 / mxfp8 against fp32 moments, gradient
bytes per parameter with --quant-grads (alone and with fp8) against the fp32 grad buffer, and the
step time each costs, on the torch trainer (Megatron-Core GPT, Megatron's Adam, mock data), in one
process, the cases interleaved so machine load hits all alike.

    python tests_extend/benchmarks/bench_quant_states.py [--layers 8 --hidden 1024 --seq 512 --steps 2]

Bytes are Adam's two moments as held between updates (fp32 tensors in the optimizer's state, plus
the 8-bit codes and their scales), counted from tensor sizes after the last update; `step` counters and
the fp32 master copies (--bf16) are left out: the flag does not change them. The embeddings' and the
output layer's moments stay fp32 (as upstream's): `quantized_share` is their complement's share of
the parameters, `bytes_per_quantized_param` what a quantized parameter takes. Gradient bytes are
Megatron-Core's DDP grad buffers (held through forward and backward) over the parameters they hold;
the fp32 copies the optimizer makes of them inside its step (Megatron's own, with or without the flag)
are left out.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests_extend.benchmarks.bench_memory_swap import _base, _step_times, _trainer  # noqa: E402


def _moment_bytes(tr) -> dict:
    from mindspeed.features.training import quantized_moments as qm
    total = params = quantized = quantized_bytes = 0
    for opt in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer]):
        states = getattr(opt, "mindspeed_quant_states", None)
        for g in opt.optimizer.param_groups:
            for p in g["params"]:
                params += p.numel()
                dense = sum(v.numel() * v.element_size() for k, v in opt.optimizer.state.get(p, {}).items()
                            if k in qm.MOMENT_DTYPES)
                packed = sum(q.nbytes() for q in states.packed.get(p, {}).values()) if states else 0
                total += dense + packed
                if states and states.quantized(p):
                    quantized += p.numel()
                    quantized_bytes += dense + packed
    return {"bytes_per_param": total / params, "quantized_share": quantized / params,
            "bytes_per_quantized_param": quantized_bytes / quantized if quantized else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per case (after one warm-up)")
    a = parser.parse_args()
    os.environ.pop("RANK", None)
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.features.training.quant_grads_megatron import grad_buffer_bytes
    from mindspeed.training import pretrain
    base = _base(a)
    mindspeed.adapt(parse_args(base, world_size=1))
    args = parse_args(base, world_size=1)
    pretrain._init_distributed(args, "cpu")
    pretrain.init_batch_schedule(args, 0)
    print(f"model: {a.layers} layers, hidden {a.hidden}, seq {a.seq}, micro-batch {a.mbs}; {os.cpu_count()} CPUs",
          flush=True)
    load0 = os.getloadavg()[0]
    rows = {}
    for name, flags in (("fp32", []), ("fp8", ["--quant-states", "fp8"]), ("mxfp8", ["--quant-states", "mxfp8"]),
                        ("quant-grads", ["--quant-grads"]), ("fp8+quant-grads", ["--quant-states", "fp8", "--quant-grads"])):
        args, tr = _trainer(base, flags)
        times = _step_times(args, tr, a.steps)
        held, params = grad_buffer_bytes(tr.model)
        rows[name] = dict(_moment_bytes(tr), step_s=statistics.median(times), grad_bytes_per_param=held / params)
        del tr
    load = f"{load0:.1f}->{os.getloadavg()[0]:.1f}"
    fp32 = rows["fp32"]
    for name, row in rows.items():
        print(f"{name}: moment bytes/param {row['bytes_per_param']:.3f} (ratio to fp32 "
              f"{row['bytes_per_param'] / fp32['bytes_per_param']:.3f}) | per quantized param "
              f"{row['bytes_per_quantized_param'] or 8.0:.3f} | quantized share {row['quantized_share']:.3f} | "
              f"grad bytes/param {row['grad_bytes_per_param']:.3f} (ratio "
              f"{row['grad_bytes_per_param'] / fp32['grad_bytes_per_param']:.3f}) | "
              f"step {row['step_s']:.2f} s (ratio {row['step_s'] / fp32['step_s']:.2f}) | load avg 1 min {load}",
              flush=True)
    mindspeed.unadapt()


if __name__ == "__main__":
    main()
