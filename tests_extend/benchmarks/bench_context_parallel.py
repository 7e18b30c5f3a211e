"""Context-parallel benchmark (CPU, torch backend, gloo): one causal attention layer's forward +
backward at long sequence lengths, CP=1 vs CP=2/4 for each algorithm, each configuration in fresh
processes (one thread each, so CP=P uses P threads where the machine has them).

Per configuration it prints, measured in the same run:
- step time (slowest rank, best of --steps) and its ratio to CP=1;
- peak memory per process: the growth of peak RSS from just before the first step to the end
  (fresh processes, so the peak is this configuration's: activations, gradients, communication
  buffers), and its ratio to CP=1; `fits` compares it with --budget-mib;
- bytes each rank sent per step (send_recv and the all_to_all share that leaves the rank),
  counted on the live comm, against the theoretical volume of the algorithm.

    python tests_extend/benchmarks/bench_context_parallel.py [--seq 4096 8192] [--attention reference] [--quick]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests_extend.distributed.harness import run_distributed  # noqa: E402

CONFIGS = [  # (label, cp size, algo, options)
    ("single process", 1, "megatron_cp_algo", {}),
    ("ulysses", 2, "ulysses_cp_algo", {}),
    ("ring", 2, "megatron_cp_algo", {}),
    ("ring+overlap", 2, "megatron_cp_algo", {"overlap": True}),
    ("ulysses", 4, "ulysses_cp_algo", {}),
    ("ring+overlap", 4, "megatron_cp_algo", {"overlap": True}),
    ("double ring w2", 4, "megatron_cp_algo", {"window_size": 2, "overlap": True}),
    ("hybrid u2", 4, "hybrid_cp_algo", {"ulysses_degree": 2}),
]


def theoretical_bytes(algo, size, options, seq, batch, heads, kv_heads, head_dim, elem):
    """Bytes one rank sends per forward+backward step."""
    q_tokens = seq // size * batch                      # local tokens
    q, kv = q_tokens * heads * head_dim * elem, q_tokens * kv_heads * head_dim * elem

    def ulysses(p, q_bytes, kv_bytes):   # fwd: q, k, v, out; bwd: their gradients
        return 2 * (2 * q_bytes + 2 * kv_bytes) * (p - 1) / p

    def ring(p, kv_bytes):               # fwd: k, v for p-1 hops; bwd: dk, dv back
        return 4 * (p - 1) * kv_bytes

    if size == 1:
        return 0
    if algo == "ulysses_cp_algo":
        return ulysses(size, q, kv)
    if algo == "megatron_cp_algo":
        return ring(size, kv)
    u = options["ulysses_degree"]
    repeats = u // __import__("math").gcd(kv_heads, u)
    ring_kv = kv * u * repeats // u                    # s/R tokens, (kv heads x repeats)/u heads
    return ulysses(u, q, kv * repeats) + ring(size // u, ring_kv)


def _count_sent(comm):
    """Count bytes leaving this rank on the live comm (instance attributes shadow the methods;
    the differentiable all_to_all calls comm.all_to_all, so backward is counted too)."""
    sent = {"bytes": 0}
    send_recv, all_to_all = comm.send_recv, comm.all_to_all

    def counted_send_recv(t, dst, src, group=None):
        sent["bytes"] += t.numel() * t.element_size()
        return send_recv(t, dst, src, group)

    def counted_all_to_all(t, scatter_dim, gather_dim, group=None):
        n = comm.world_size(group)
        sent["bytes"] += t.numel() * t.element_size() * (n - 1) / n
        return all_to_all(t, scatter_dim, gather_dim, group)

    comm.send_recv, comm.all_to_all = counted_send_recv, counted_all_to_all
    return sent


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _body(rank, world_size, algo, options, seq, batch, heads, kv_heads, head_dim, steps, attention):
    import torch
    torch.set_num_threads(1)
    from mindspeed.backends import get_backend
    kernels = get_backend().kernels
    if attention == "reference":     # the plain kernel: materialised [b, n, sq, skv] scores
        kernels.attention = kernels.reference.attention
    from mindspeed.features.context_parallel import build_cp_groups, context_parallel_attention, local_positions
    torch.manual_seed(0)
    cp = build_cp_groups(algo, backend=get_backend(), **options)
    comm = get_backend().comm

    def inputs(seq_len):
        s_local = len(local_positions(seq_len, algo, cp.size, cp.rank, cp.ulysses_degree))
        leaf = lambda h: torch.randn(s_local, batch, h * head_dim).requires_grad_(True)  # noqa: E731
        return leaf(heads), leaf(kv_heads), leaf(kv_heads), torch.randn(s_local, batch, heads * head_dim)

    def step(q, k, v, dout):
        context_parallel_attention(q, k, v, cp, head_num=heads, causal=True).backward(dout)

    # a small step first touches every code path (library pages, thread pools, connections), so the
    # peak-RSS growth below is this size's tensors and buffers, not one-time start-up
    step(*inputs(16 * cp.size))
    tensors = inputs(seq)
    comm.barrier()
    base = _peak_rss()
    step(*tensors)                                      # warm-up at full size
    sent = _count_sent(comm)
    times = []
    for _ in range(steps):
        comm.barrier()
        start = time.perf_counter()
        step(*tensors)
        comm.barrier()
        times.append(time.perf_counter() - start)
    return dict(step_s=min(times), peak_growth=_peak_rss() - base, sent=sent["bytes"] / steps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--budget-mib", type=float, default=None,
                   help="per-process memory budget for the `fits` column (default: 60%% of CP=1's peak at that length)")
    p.add_argument("--attention", choices=["fast", "reference"], default="fast",
                   help="fast: the backend's attention (CPU flash, O(s) memory); reference: the plain "
                        "kernel, whose O(s^2) scores make long sequences not fit one process")
    p.add_argument("--quick", action="store_true", help="--seq 2048, one step (a smoke run)")
    a = p.parse_args(argv)
    if a.quick:
        a.seq, a.steps = [2048], 1
    shape = (a.batch, a.heads, a.kv_heads, a.head_dim)
    print(f"causal attention ({a.attention} kernel) fwd+bwd, fp32, batch {a.batch}, heads {a.heads} (kv {a.kv_heads}) x {a.head_dim}, "
          f"one thread per process, {os.cpu_count()} cores; budget "
          + (f"{a.budget_mib:.0f} MiB" if a.budget_mib is not None else "60% of CP=1's peak"))
    header = (f"{'seq':>6} {'config':<16} {'P':>2} {'step ms':>9} {'x CP1':>6} {'peak MiB/proc':>13} "
              f"{'x CP1':>6} {'fits':>5} {'sent MiB/rank':>13} {'theory MiB':>10} {'sent/theory':>11}")
    print(header)
    print("-" * len(header))
    for seq in a.seq:
        base_time = base_mem = None
        for label, size, algo, options in CONFIGS:
            ranks = run_distributed(_body, world_size=size, timeout=1800,
                                    args=(algo, options, seq, *shape, a.steps, a.attention))
            step = max(r["step_s"] for r in ranks)
            mem = max(r["peak_growth"] for r in ranks) / 2**20
            sent = max(r["sent"] for r in ranks) / 2**20
            theory = theoretical_bytes(algo, size, options, seq, *shape, 4) / 2**20
            if size == 1:
                base_time, base_mem = step, mem
            budget = a.budget_mib if a.budget_mib is not None else 0.6 * base_mem
            ratio = f"{sent / theory:11.3f}" if theory else f"{'-':>11}"
            print(f"{seq:>6} {label:<16} {size:>2} {1000 * step:>9.0f} {step / base_time:>6.2f} {mem:>13.0f} "
                  f"{mem / max(base_mem, 1e-9):>6.2f} {'yes' if mem <= budget else 'no':>5} {sent:>13.1f} "
                  f"{theory:>10.1f} {ratio}", flush=True)


if __name__ == "__main__":
    main()
