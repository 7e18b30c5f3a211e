"""Step time of the MindSpore trainer vs Megatron-Core GPTModel on torch, same GPT config, same
batches, one process, fp32 on CPU, measured in one run with the steps interleaved (torch step,
mindspore step, ...) so both see the same machine load. Prints the medians and their ratio.

    python tests_extend/benchmarks/bench_mindspore_trainer.py [--layers 4 --hidden 128 --seq 128 --mbs 16 --steps 6]

The thread count changes the ratio: OMP_NUM_THREADS sets torch's threads and MindSpore's CPU kernel
pool alike (the line printed says how many torch used); measure with 1 and with the variable unset.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--steps", type=int, default=6, help="timed steps per backend (after 2 warm-up steps)")
    a = p.parse_args(argv)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("GLOG_v", "3")
    import torch
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    import mindspeed
    mindspeed.adapt([])
    from tests_extend import megatron_tiny
    from tests_extend.distributed import mindspore_parity as mp
    megatron_tiny.init_parallel(tp=1)
    # the parity module's GPT and optimizer, resized
    mp.LAYERS, mp.HIDDEN, mp.HEADS, mp.GROUPS, mp.FFN = a.layers, a.hidden, a.heads, a.heads, 4 * a.hidden
    mp.VOCAB, mp.SEQ, mp.MBS, mp.STEPS = a.vocab, a.seq, a.mbs, 1000

    model = mp.build_torch_model(1)
    opt = mp.megatron_adamw(model.parameters())
    ckpt = tempfile.mkdtemp()
    mp.save_torch_init(model, ckpt)

    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore import checkpoint
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    backend = MindSporeBackend("cpu")
    args = parse_args(mp.trainer_argv(1), world_size=1)
    args.ffn_hidden_size, args.num_query_groups = mp.FFN, mp.GROUPS
    trainer = Trainer(args, backend, build_parallel_state(backend.comm, 1, False), GPTConfig.from_args(args, mp.VOCAB))
    checkpoint.load(ckpt, trainer.model)

    def torch_step(i):
        opt.zero_grad()
        loss = mp._torch_loss(model, i)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    def ms_step(i):
        tokens, labels, mask = mp.batch(i)
        return trainer.train_step([{"tokens": tokens, "labels": labels, "loss_mask": mask}], i + 1)[0]

    times = {"torch": [], "mindspore": []}
    for i in range(a.steps + 2):
        for name, step in (("torch", torch_step), ("mindspore", ms_step)):
            start = time.perf_counter()
            step(i)
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    t, m = statistics.median(times["torch"]), statistics.median(times["mindspore"])
    print(f"config: layers {a.layers}, hidden {a.hidden}, heads {a.heads}, seq {a.seq}, micro-batch {a.mbs}, "
          f"vocab {a.vocab}, fp32, 1 process, {torch.get_num_threads()} torch threads, load avg {os.getloadavg()[0]:.1f}")
    print("| trainer | median step (ms) | tokens/s |")
    print("|---|---|---|")
    for name, v in (("torch (Megatron-Core GPTModel)", t), (f"mindspore (native trainer, {'graph' if trainer.graph_mode else 'PyNative'})", m)):
        print(f"| {name} | {1000 * v:.1f} | {a.seq * a.mbs / v:.0f} |")
    print(f"step time ratio mindspore / torch: {m / t:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
