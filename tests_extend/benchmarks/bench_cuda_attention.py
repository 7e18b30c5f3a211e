"""Attention on a CUDA GPU: the CUDA path (torch's memory-efficient kernel, kernels/cuda.py) against
the reference (scores in memory), forward+backward time and peak memory, in one run.

    python tests_extend/benchmarks/bench_cuda_attention.py [--reps 10]

Causal self-attention in Megatron's layout [s, b, n*d], bf16 and fp32, head dim 128, at sequence
lengths 1024-8192; one more row with a band (--sparse-mode 4 style) through the kernel's bias path.
Times are CUDA-event medians after warm-up; peak memory is the allocator's peak of one
forward+backward above what the inputs hold. Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from mindspeed.backends.torch.kernels import cuda as CU          # noqa: E402
from mindspeed.backends.torch.kernels import reference as R      # noqa: E402

CASES = [  # (seq, batch, heads, dtype, band pre_tokens or None)
    (1024, 4, 16, torch.bfloat16, None), (4096, 2, 16, torch.bfloat16, None), (8192, 1, 16, torch.bfloat16, None),
    (4096, 2, 16, torch.float32, None), (4096, 2, 16, torch.bfloat16, 512),
]
HEAD_DIM = 128


def _step(fn, q, k, v, grad):
    out = fn(q, k, v)[0]
    out.backward(grad)


def _measure(fn, q, k, v, grad, reps):
    """(median ms of forward+backward, peak MiB above the inputs), or None when it runs out of memory."""
    try:
        for _ in range(2):
            _step(fn, q, k, v, grad)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(fn, q, k, v, grad)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(fn, q, k, v, grad)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times), peak
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        for t in (q, k, v):
            t.grad = None
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10)
    opts = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    print(f"{time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name()} torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f}, head dim {HEAD_DIM}, fwd+bwd")
    print("| seq | batch | heads | dtype | mask | reference ms | cuda path ms | speed-up | reference MiB | cuda path MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seq, batch, heads, dtype, band in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (seq, batch, heads * HEAD_DIM)
        q, k, v = (torch.randn(shape, generator=g, device="cuda", dtype=dtype).requires_grad_() for _ in range(3))
        grad = torch.randn(shape, generator=g, device="cuda", dtype=dtype)
        kw = dict(layout="SBH", head_num=heads, causal=True)
        if band is not None:
            kw.update(pre_tokens=band, next_tokens=0)
        ref = _measure(lambda *t: R.attention(*t, **kw), q, k, v, grad, opts.reps)
        fast = _measure(lambda *t: CU.attention(*t, **kw), q, k, v, grad, opts.reps)
        fmt = lambda r, i: "out of memory" if r is None else f"{r[i]:.2f}" if i == 0 else f"{r[i]:.0f}"  # noqa: E731
        ratio = f"{ref[0] / fast[0]:.1f}x" if ref and fast else "-"
        print(f"| {seq} | {batch} | {heads} | {str(dtype).split('.')[-1]} | {'band ' + str(band) if band else 'causal'} "
              f"| {fmt(ref, 0)} | {fmt(fast, 0)} | {ratio} | {fmt(ref, 1)} | {fmt(fast, 1)} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
