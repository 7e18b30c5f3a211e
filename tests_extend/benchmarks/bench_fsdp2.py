"""Bytes each rank holds for the model's training state under DDP, the distributed optimizer and
--use-torch-fsdp2, on the torch trainer (Megatron-Core GPT, Megatron's Adam, mock data, fp32) at DP 2,
in one 2-process run, counted from tensor sizes after one update:

    python tests_extend/benchmarks/bench_fsdp2.py [--layers 4 --hidden 256]

params: the parameters' storage on this rank (FSDP2: its shards); grads: DDP's gradient buffers (the
distributed optimizer keeps the whole buffer too and reduce-scatters into it), FSDP2's sharded .grad;
states: the optimizer's tensors (Adam's moments; the distributed optimizer's are for its shard).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

LAYOUTS = {"ddp": [], "distributed optimizer": ["--use-distributed-optimizer"], "fsdp2": ["--use-torch-fsdp2"]}


def _bytes(tr) -> dict:
    from megatron.core.utils import to_local_if_dtensor
    params = [p for chunk in tr.model for p in chunk.parameters()]
    local = [to_local_if_dtensor(p) for p in params]
    # DDP's gradient buffers (a list; on the FSDP2 wrapper `buffers` is nn.Module's method)
    buffers = [b for chunk in tr.model if isinstance(chunk.buffers, list) for b in chunk.buffers]
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers) if buffers else \
        sum(to_local_if_dtensor(p.grad).numel() * 4 for p in params if p.grad is not None)
    states = [t for opt in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
              for s in opt.optimizer.state.values() for t in s.values() if hasattr(t, "dim") and t.dim() > 0]
    return {"params": sum(t.numel() * t.element_size() for t in local), "grads": grads,
            "states": sum(to_local_if_dtensor(t).numel() * to_local_if_dtensor(t).element_size() for t in states)}


def per_rank(rank, world_size, model_flags):
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training import pretrain
    from tests_extend.unit import swap_workers as kit
    base = model_flags + ["--global-batch-size", "4", "--untie-embeddings-and-output-weights"]
    args = parse_args(kit.TINY + base, world_size=world_size)
    mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain.init_batch_schedule(args, rank)
    out = {}
    for name, flags in LAYOUTS.items():
        args, tr = kit.trainer_for(base + flags, world_size=world_size)
        tr.train_step(kit.batches(args, tr))
        out[name] = _bytes(tr)
    mindspeed.unadapt()
    return out


def main() -> None:
    from tests_extend.distributed.harness import run_distributed
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args()
    model = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden)]
    load = os.getloadavg()
    ranks = run_distributed(per_rank, world_size=2, args=(model,), timeout=600, daemon=False)
    print(f"layers {a.layers}, hidden {a.hidden}, fp32, DP 2; load average before {tuple(round(v, 2) for v in load)}")
    for rank, out in enumerate(ranks):
        base = sum(out["ddp"].values())
        for name, parts in out.items():
            total = sum(parts.values())
            print(f"rank {rank} {name:22s} params {parts['params'] / 2**20:7.2f} MiB  grads {parts['grads'] / 2**20:7.2f} "
                  f"MiB  states {parts['states'] / 2**20:7.2f} MiB  total {total / 2**20:7.2f} MiB  "
                  f"({total / base:.3f} of DDP's)")


if __name__ == "__main__":
    main()
