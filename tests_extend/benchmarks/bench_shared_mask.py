"""Bytes the shared attention mask saves (always on; mindspeed/features/memory/shared_mask.py), on the
torch trainer (Megatron-Core GPT, local spec, unfused attention), measured in one run:

    python tests_extend/benchmarks/bench_shared_mask.py [--layers 8 --hidden 1024 --seq 1024 --mbs 1 --micro-batches 2]

* default mask (no mask passed; Megatron builds one in each layer's softmax): bool mask bytes saved for
  backward over one forward, Megatron's per-call mask vs the cached one;
* data-loader mask (what the built-in trainer passes): mask bytes allocated for --micro-batches
  micro-batches (a stacked [mbs, 1, s, s] copy each vs the one shared mask), and mask bytes saved for
  backward while their forwards are all in flight (as pipeline schedules keep them).
Prints the load average: the machine may be busy.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
MiB = 2 ** 20


def saved_mask_bytes(run, seq) -> int:
    """Bytes of distinct bool [.., seq, seq] storages saved for backward while `run()` builds its graphs."""
    import torch
    storages = {}

    def pack(t):
        if t.dtype == torch.bool and tuple(t.shape[-2:]) == (seq, seq):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        keep = run()
    del keep
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=2)
    a = parser.parse_args()
    os.environ.pop("RANK", None)
    load0 = os.getloadavg()[0]
    import mindspeed
    from megatron.core.fusions import fused_softmax
    from mindspeed.training import pretrain
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.data import get_batch
    from tests_extend.benchmarks.bench_memory_swap import _base, _iterator, _trainer
    a.steps = 1
    base = _base(a) + ["--global-batch-size", str(a.mbs * a.micro_batches)]
    args = parse_args(base, world_size=1)
    mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain.init_batch_schedule(args, 0)
    args, tr = _trainer(base, [])
    model, s = tr.model[0], a.seq
    it = _iterator(args, tr)
    batches = [get_batch(it, "cpu") for _ in range(a.micro_batches)]

    def forwards(masks):
        return [model(b["tokens"], b["position_ids"], m, labels=b["labels"]) for b, m in zip(batches, masks)]

    cached = fused_softmax.get_default_causal_mask
    fused_softmax.get_default_causal_mask = cached.__wrapped__          # Megatron's own: a mask per call
    try:
        default_off = saved_mask_bytes(lambda: forwards([None]), s)
    finally:
        fused_softmax.get_default_causal_mask = cached
    default_on = saved_mask_bytes(lambda: forwards([None]), s)
    stacked = [b["attention_mask"].expand(a.mbs, -1, -1, -1).clone() for b in batches]   # the old loader
    data_off = saved_mask_bytes(lambda: forwards(stacked), s)
    data_on = saved_mask_bytes(lambda: forwards([b["attention_mask"] for b in batches]), s)
    shared = {b["attention_mask"].untyped_storage().data_ptr() for b in batches}
    alloc_off = sum(m.untyped_storage().nbytes() for m in stacked)
    alloc_on = batches[0]["attention_mask"].untyped_storage().nbytes() * len(shared)
    print(f"model: {a.layers} layers, hidden {a.hidden}, seq {s}, micro-batch {a.mbs}, "
          f"{a.micro_batches} micro-batches; load average {load0:.1f}->{os.getloadavg()[0]:.1f}")
    print(f"default mask (none passed), saved for backward in one forward: {default_off / MiB:.2f} MiB "
          f"per-layer masks -> {default_on / MiB:.2f} MiB shared (saves {(default_off - default_on) / MiB:.2f} MiB)")
    print(f"data-loader mask, allocated for {a.micro_batches} micro-batches: {alloc_off / MiB:.2f} MiB -> "
          f"{alloc_on / MiB:.2f} MiB; saved for backward with all in flight: {data_off / MiB:.2f} MiB -> "
          f"{data_on / MiB:.2f} MiB")
    mindspeed.unadapt()


if __name__ == "__main__":
    main()
