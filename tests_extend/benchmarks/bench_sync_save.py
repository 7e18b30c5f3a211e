"""A synchronous dist-checkpoint save in a fresh process, with MindSpeed's in-process results queue
against Megatron-Core's own path (its spawned Manager; the rest of `mindspeed.adapt`'s cpu shim,
which Megatron needs to save on a CPU at all, in both), alternating over the
rounds in fresh processes so both see the same load. Prints the median wall time of each process's
first and second save, the ratio of the first saves, and the load average before and after.

    python tests_extend/benchmarks/bench_sync_save.py [--rounds 5] [--mib 8]

One process, gloo world of 1, one fp32 tensor of --mib MiB saved with dist_checkpointing.save
(Megatron's default torch_dist strategy), as the built-in torch trainer and Megatron-LM save.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAYS = ("megatron", "mindspeed")


def child(way: str, mib: int, folder: str) -> None:
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    import mindspeed
    from mindspeed.backends.torch.sync_save_queue import SYNC_SAVE
    state = mindspeed.adapt([])
    if way == "megatron":
        state.patcher.remove(SYNC_SAVE)
    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    weight = torch.randn(mib * 2**18)
    seconds = []
    for i in range(2):
        path = os.path.join(folder, f"save{i}")
        os.makedirs(path)
        start = time.perf_counter()
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight)}, path)
        seconds.append(time.perf_counter() - start)
    dist.destroy_process_group()
    print(json.dumps(seconds))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mib", type=int, default=8)
    p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.child:
        with tempfile.TemporaryDirectory() as folder:
            child(opts.child, opts.mib, folder)
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    times = {way: ([], []) for way in WAYS}
    for _ in range(opts.rounds):
        for way in WAYS:
            out = subprocess.run([sys.executable, __file__, "--mib", str(opts.mib), "--child", way],
                                 capture_output=True, text=True, check=True).stdout
            first, second = json.loads(out.strip().splitlines()[-1])
            times[way][0].append(first)
            times[way][1].append(second)
    for way in WAYS:
        first, second = (statistics.median(t) for t in times[way])
        print(f"{way:>9}: first save {first * 1000:.0f} ms, second save {second * 1000:.0f} ms")
    ratio = statistics.median(times["megatron"][0]) / statistics.median(times["mindspeed"][0])
    print(f"first save, Megatron's path / MindSpeed's: {ratio:.2f}x ({opts.rounds} rounds, {opts.mib} MiB)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
