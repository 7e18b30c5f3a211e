"""LoRA against full fine-tuning on the torch trainer (Megatron-Core GPT, one process), each mode in a
fresh process so their memory peaks do not mix:

    python tests_extend/benchmarks/bench_lora.py [--layers 4 --hidden 512 --seq 256 --mbs 2 --steps 5 --lora-r 16]

Per mode: median optimizer-step time over --steps steps (after 2 warm-up steps), trainable
parameters, the bytes of training state (parameters, gradient buffers, optimizer state) and the
process's peak resident memory. Prints the load average before and after: timings from a busy
machine are not comparable.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
MiB = 2 ** 20
LORA = ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


class _Log:
    def print(self, *_):
        pass


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def measure(a) -> dict:
    """One mode in this process: build the trainer, time its steps, size its state."""
    import torch
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training import pretrain
    flags = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "8",
             "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--micro-batch-size", str(a.mbs),
             "--global-batch-size", str(a.mbs), "--train-iters", "100", "--lr", "1e-4", "--mock-data",
             "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--device", "cpu"]
    if a.mode == "lora":
        flags += LORA + ["--lora-r", str(a.lora_r), "--lora-alpha", str(2 * a.lora_r)]
    args = parse_args(flags, world_size=1)
    state = mindspeed.adapt(args)
    args.device_name = "cpu"
    args.vocab_size = args.padded_vocab_size = 1024
    pretrain._init_distributed(args, "cpu")
    pretrain._set_seeds(args)
    pretrain.init_batch_schedule(args, 0)
    trainer = pretrain.Trainer(args, _Log(), lora=state.context.part("lora"))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1024, (a.mbs, a.seq + 1), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(a.mbs, a.seq),
             "position_ids": torch.arange(a.seq).expand(a.mbs, a.seq)}
    times = []
    for step in range(2 + a.steps):
        start = time.perf_counter()
        trainer.train_step(iter([batch]))
        if step >= 2:
            times.append(time.perf_counter() - start)
    params = [p for chunk in trainer.model for p in chunk.parameters()]
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    opt_state = [v for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
                 for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"mode": a.mode, "step_s": statistics.median(times),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "parameters": sum(p.numel() for p in params),
            "state_mib": (_tensor_bytes(params) + _tensor_bytes(grads) + _tensor_bytes(opt_state)) / MiB,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--mode", choices=["lora", "full"], default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.mode:
        print(json.dumps(measure(a)), flush=True)
        return
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rows = []
    for mode in ("full", "lora"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode], capture_output=True,
                             text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"layers {a.layers}, hidden {a.hidden}, seq {a.seq}, micro-batch {a.mbs}, LoRA r {a.lora_r} on "
          f"{' '.join(LORA[1:])}")
    print(f"{'mode':6} {'step s':>8} {'trainable':>11} {'parameters':>11} {'state MiB':>10} {'peak RSS MiB':>13}")
    for r in rows:
        print(f"{r['mode']:6} {r['step_s']:8.3f} {r['trainable']:11d} {r['parameters']:11d} {r['state_mib']:10.1f} "
              f"{r['peak_rss_mib']:13.1f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
