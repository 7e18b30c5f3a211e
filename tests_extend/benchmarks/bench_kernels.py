"""Kernel benchmark (CPU): forward+backward time of the reference, the fast path and
torch.compile(reference), ratios, achieved bandwidth against a plain tensor copy measured in the
same run, and attention peak memory vs sequence length.

    python tests_extend/benchmarks/bench_kernels.py [--quick] [--no-compile] [--threads N]

One compute thread by default, as the trainer runs (OMP_NUM_THREADS=1 per process). With one
thread the times are the calling thread's CPU time (time.thread_time): a thread waiting for a core
accrues none, so other processes inflate it less than wall-clock time (they still share caches and
memory bandwidth: keep the load average low); with more threads, wall-clock. The
elementwise kernels run at the rows of a micro-batch (2048 tokens) and three widths: the
example's hidden 128 (head dim 32), the step-time issue's 512 (head dim 64) and 4096 (head dim 128).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from mindspeed.backends.torch.kernels import cpu as C            # noqa: E402
from mindspeed.backends.torch.kernels import reference as R      # noqa: E402
from mindspeed.backends.torch.kernels.csrc import fused_ops      # noqa: E402


def clock():
    """Thread CPU time with one compute thread (robust to other processes' load), else wall."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def best_time(fn, reps: int) -> float:
    fn()                                            # warm-up (and JIT/compile)
    fn()
    times = []
    for _ in range(reps):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def fwd_bwd(kernel, inputs, first_only=True):
    """A closure running kernel forward + backward with a ones cotangent on its first output."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]

    def step():
        for t in leaves:
            t.grad = None
        out = kernel(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
    return step


def copy_bandwidth(reps: int) -> float:
    x = torch.randn(64 * 1024 * 1024 // 4)          # 64 MiB
    t = best_time(lambda: x.clone(), reps)
    return 2 * x.numel() * 4 / t / 1e9              # read + write


def try_compile(fn):
    try:
        compiled = torch.compile(fn, dynamic=False)
        return compiled
    except Exception as exc:   # noqa: BLE001 - report, never fail the benchmark
        return f"compile failed: {type(exc).__name__}"


IN_CACHE_BYTES = 64 * 1024 * 1024    # smaller working sets run from cache, faster than the DRAM copy


def row(name, bytes_moved, ref_t, fast_t, comp_t, copy_bw):
    ratio = f"{ref_t / fast_t:5.2f}x" if fast_t else "   - "
    comp = f"{comp_t * 1e3:9.1f}" if isinstance(comp_t, float) else f"{'n/a':>9}"
    comp_ratio = f"{ref_t / comp_t:5.2f}x" if isinstance(comp_t, float) else "   - "
    fast = f"{fast_t * 1e3:9.1f}" if fast_t else f"{'-':>9}"
    if fast_t and bytes_moved >= IN_CACHE_BYTES:
        bw = f"{bytes_moved / fast_t / 1e9:6.1f} ({bytes_moved / fast_t / 1e9 / copy_bw:4.0%})"
    elif fast_t and bytes_moved:
        bw = f"{bytes_moved / fast_t / 1e9:6.1f} (cache)"   # the copy reference is a DRAM figure
    else:
        bw = f"{'-':>13}"
    print(f"| {name:34s} | {ref_t * 1e3:9.1f} | {fast} | {ratio} | {comp} | {comp_ratio} | {bw} |")


def elementwise_cases(s, h, hd, dtype):
    es = torch.finfo(dtype).bits // 8
    tag = "fp32" if dtype == torch.float32 else "bf16"
    n = s * h
    cos, sin = torch.randn(s, 1, 1, hd), torch.randn(s, 1, 1, hd)
    return [
        (f"rms_norm [{s},{h}] {tag}", R.rms_norm, C.rms_norm,
         [torch.randn(s, h, dtype=dtype), torch.randn(h, dtype=dtype)], 5 * n * es),
        (f"swiglu [{s},{2 * h}] {tag}", R.swiglu, C.swiglu, [torch.randn(s, 2 * h, dtype=dtype)], 8 * n * es),
        (f"rope [{s},1,{h // hd},{hd}] {tag}", lambda x: R.rope(x, cos, sin, 0), lambda x: C.rope(x, cos, sin, 0),
         [torch.randn(s, 1, h // hd, hd, dtype=dtype)], 4 * n * es),
    ]


def bench_elementwise(args, copy_bw):
    widths = [(512, 4096, 128)] if args.quick else [(2048, 128, 32), (2048, 512, 64), (2048, 4096, 128)]
    for dtype in (torch.float32, torch.bfloat16):
        for s, h, hd in widths:
            for name, ref, fast, inputs, nbytes in elementwise_cases(s, h, hd, dtype):
                ref_t = best_time(fwd_bwd(ref, inputs), args.reps)
                fast_t = best_time(fwd_bwd(fast, inputs), args.reps)
                comp_t = compiled_time(args, ref, inputs, args.reps)
                row(name, nbytes, ref_t, fast_t, comp_t, copy_bw)
                if isinstance(comp_t, float) and comp_t < fast_t:
                    print(f"|   ^ torch.compile(reference) is {fast_t / comp_t:.2f}x faster than the fast path here |")


def compiled_time(args, ref, inputs, reps):
    """fwd+bwd time of torch.compile(ref), or why there is none."""
    if args.no_compile:
        return "skipped"
    compiled = try_compile(ref)
    if isinstance(compiled, str):
        return compiled
    try:
        return best_time(fwd_bwd(compiled, inputs), reps)
    except Exception as exc:   # noqa: BLE001 - report, never fail the benchmark
        return f"failed: {type(exc).__name__}"


def bench_attention(args, copy_bw):
    # the example's (micro-batch 16, 4 heads of 32, seq 128), the (4, 8 x 64, 512), a long one
    shapes = [(1024, 1, 4, 128)] if args.quick else [(128, 16, 4, 32), (512, 4, 8, 64), (4096, 1, 4, 128)]
    for s, b, n, d in shapes:
        q, k, v = (torch.randn(s, b, n * d) for _ in range(3))
        kw = dict(layout="SBH", head_num=n, causal=True)
        reps = max(1, args.reps // 3) if s >= 4096 else args.reps
        ref = lambda q, k, v: R.attention(q, k, v, **kw)
        ref_t = best_time(fwd_bwd(ref, [q, k, v]), reps)
        fast = lambda q, k, v: C.attention(q, k, v, **kw)
        fast_t = best_time(fwd_bwd(fast, [q, k, v]), reps)
        comp_t = compiled_time(args, ref, [q, k, v], reps) if s < 4096 else "skipped"
        path = _attention_path(s, b, n, d)
        row(f"attention causal SBH s={s} b={b} n={n} d={d} ({path})", 0, ref_t, fast_t, comp_t, copy_bw)
        if path == "gemm":    # the flash kernel it replaces, same shape
            with _flash_only():
                flash_t = best_time(fwd_bwd(fast, [q, k, v]), reps)
            row(f"  same, torch's flash kernel", 0, ref_t, flash_t, "skipped", copy_bw)


def _attention_path(s, b, n, d) -> str:
    q = torch.empty(b, n, s, d)
    return "gemm" if C.gemm_attention_pays(q, q, plain_causal=True) else "flash"


@contextlib.contextmanager
def _flash_only():
    keep, C.GEMM_MAX_SEQ = C.GEMM_MAX_SEQ, 0
    try:
        yield
    finally:
        C.GEMM_MAX_SEQ = keep


def bench_others(args, copy_bw):
    tokens, k_in, n_out = (512, 1024, 1024) if args.quick else (2048, 1024, 4096)
    x, dy = torch.randn(tokens, k_in), torch.randn(tokens, n_out)
    mg_r, mg_f = torch.zeros(n_out, k_in), torch.zeros(n_out, k_in)
    ref_t = best_time(lambda: R.matmul_add_fp32(x, dy, mg_r), args.reps)
    fast_t = best_time(lambda: mg_f.addmm_(dy.t(), x), args.reps)   # candidate, not adopted (GEMM-bound)
    row(f"matmul_add_fp32 [{tokens},{k_in}]x[{tokens},{n_out}] (addmm_)", 0, ref_t, fast_t, "skipped", copy_bw)
    xg, w = torch.randn(4096, 1024), torch.randn(8, 1024, 512)
    sizes = [1024, 0, 512, 512, 1024, 0, 512, 512]
    gmm_ref = lambda x, w: R.gmm(x, w, sizes, 1)
    row("gmm [4096,1024]x8x[1024,512] (in-place GEMMs)", 0,
        best_time(fwd_bwd(gmm_ref, [xg, w]), args.reps),
        best_time(fwd_bwd(lambda x, w: C.gmm(x, w, sizes, 1), [xg, w]), args.reps),
        compiled_time(args, gmm_ref, [xg, w], args.reps), copy_bw)
    out, dx, dw, dy = torch.empty(4096, 512), torch.empty(4096, 1024), torch.empty(8, 1024, 512), torch.ones(4096, 512)

    def gemms_alone():      # the ceiling of any gmm: its 3 GEMMs per group, no autograd, no copies
        a = 0
        for g, n in enumerate(sizes):
            if n:
                torch.mm(xg[a:a + n], w[g], out=out[a:a + n])
                torch.mm(dy[a:a + n], w[g].t(), out=dx[a:a + n])
                torch.mm(xg[a:a + n].t(), dy[a:a + n], out=dw[g])
            a += n
    row("gmm: its GEMMs alone (ceiling)", 0,
        best_time(fwd_bwd(lambda x, w: R.gmm(x, w, sizes, 1), [xg, w]), args.reps),
        best_time(gemms_alone, args.reps), "skipped", copy_bw)
    tok = torch.randn(4096, 1024)
    routing = torch.zeros(4096, 8, dtype=torch.bool)
    routing[torch.arange(4096)[:, None], torch.randint(0, 8, (4096, 2))] = True

    def permute_roundtrip(kernels):
        def fn(t):
            p, idx = kernels.moe_permute(t, routing)
            return kernels.moe_unpermute(p, idx, None, t.shape)
        return fn
    row("moe permute+unpermute [4096,1024] E8 top2", 0,
        best_time(fwd_bwd(permute_roundtrip(R), [tok]), args.reps),
        best_time(fwd_bwd(permute_roundtrip(C), [tok]), args.reps),
        compiled_time(args, permute_roundtrip(R), [tok], args.reps), copy_bw)
    idx = routing.t().nonzero()[:, 1]
    rows, back = torch.empty(idx.numel(), 1024), torch.empty(4096, 1024)

    def row_moves_alone():  # the ceiling of any permute+unpermute: gathers and sums into preallocated rows
        torch.index_select(tok, 0, idx, out=rows)              # permute
        back.zero_().index_add_(0, idx, rows)                  # unpermute
        torch.index_select(back, 0, idx, out=rows)             # unpermute backward
        back.zero_().index_add_(0, idx, rows)                  # permute backward
    row("moe permute+unpermute: row moves alone (ceiling)", 0,
        best_time(fwd_bwd(permute_roundtrip(R), [tok]), args.reps), best_time(row_moves_alone, args.reps),
        "skipped", copy_bw)


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return float("nan")


def attention_peak_extra_mib(impl: str, s: int, n: int = 4, d: int = 64) -> float:
    """Extra peak resident memory (MiB) of one causal attention forward+backward: the kernel's
    high-water mark is reset (Linux clear_refs 5) just before the call."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(s, 1, n * d, requires_grad=True) for _ in range(3))
    fn = R.attention if impl == "reference" else C.attention
    fn(*(torch.randn(8, 1, n * d) for _ in range(3)), layout="SBH", head_num=n)   # load code paths first
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_mib("VmRSS")
    out = fn(q, k, v, layout="SBH", head_num=n, causal=True)[0]
    out.sum().backward()
    peak = _status_mib("VmHWM")
    del out, q, k, v
    gc.collect()
    return peak - base


def _peak_in_child(impl: str, s: int, n: int) -> float:
    """attention_peak_extra_mib in a fresh process (the allocator keeps memory between cells)."""
    code = ("import sys; sys.path.insert(0, %r); import bench_kernels as b; "
            "print(b.attention_peak_extra_mib(%r, %d, %d))" % (os.path.dirname(os.path.abspath(__file__)), impl, s, n))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    try:
        return float(res.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return float("nan")


def bench_attention_memory(args):
    sizes = [1024, 2048, 4096] if not args.quick else [512, 1024, 2048]
    n = 4
    print(f"\nattention extra peak memory, causal fwd+bwd, b=1 n={n} d=64 (MiB):")
    print(f"| {'seq':>6} | {'reference':>10} | {'fast':>14} | {'one fp32 [n,s,s] tensor':>24} |")
    print(f"|{'-' * 8}|{'-' * 12}|{'-' * 16}|{'-' * 26}|")
    for s in sizes:
        ref, fast = (_peak_in_child(impl, s, n) for impl in ("reference", "fast"))
        fast_cell = f"{fast:.1f} ({_attention_path(s, 1, n, 64)})"
        print(f"| {s:>6} | {ref:>10.1f} | {fast_cell:>14} | {n * s * s * 4 / 2**20:>24.1f} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile(reference)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="compute threads (the trainer: 1 per process)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads ({'thread CPU' if torch.get_num_threads() == 1 else 'wall-clock'} time), fused C++: "
          f"{'built' if fused_ops() is not None else 'unavailable'}")
    copy_bw = copy_bandwidth(args.reps)
    print(f"plain tensor copy bandwidth: {copy_bw:.1f} GB/s\n")
    print("forward+backward, best of reps, ms; ratio = reference / other; bandwidth of the fast path "
          "(GB/s, share of copy):")
    print(f"| {'kernel':34s} | {'reference':>9} | {'fast':>9} | {'ratio':>6} | {'compile':>9} | {'ratio':>6} "
          f"| {'fast GB/s':>13} |")
    print(f"|{'-' * 36}|{'-' * 11}|{'-' * 11}|{'-' * 7}|{'-' * 11}|{'-' * 7}|{'-' * 15}|")
    bench_elementwise(args, copy_bw)
    bench_attention(args, copy_bw)
    bench_others(args, copy_bw)
    bench_attention_memory(args)
    print(f"\nload average {tuple(round(v, 2) for v in os.getloadavg())} (1, 5, 15 min; the machine's cores: "
          f"{os.cpu_count()})")


if __name__ == "__main__":
    main()
