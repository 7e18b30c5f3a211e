"""Routes to a threaded matmul for the MindSpore trainer on CPU, timed in one run.

    python tests_extend/benchmarks/bench_mindspore_matmul_threads.py [--reps 10]

fp32 [4096, 1024] x [1024, 1024], median of --reps after 2 warm-ups, each way at 1 and at 2 BLAS /
compute threads and at 1 thread with the process pinned to one core (a fresh process each: OpenBLAS
reads OPENBLAS_NUM_THREADS at import); MindSpore's PyNative ops synchronous, as the MindSpore backend
sets them on CPU (--asynchronous: MindSpore's default dispatch):
numpy's matmul, torch's, MindSpore's MatMul (PyNative, synchronized with asnumpy), numpy over
zero-copy views of MindSpore tensors on the Python thread, and the same numpy call as a pyfunc
`ops.Custom` (run by MindSpore's runtime); and MindSpore's MatMul timed on MindSpore's own thread
(between two pyfunc marks) while the Python thread waits for it in asnumpy() or sleeps. Prints the
load average before and after: rerun above 1.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = ((4096, 1024), (1024, 1024))


def _median_ms(fn, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def measure(reps: int, pinned: bool, synchronous: bool) -> dict:
    """Every route in this process (its thread count comes from the environment)."""
    if pinned:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import numpy as np
    import torch
    import mindspore as ms
    from mindspore import ops
    from mindspore.device_context.cpu import op_tuning
    threads = int(os.environ["OPENBLAS_NUM_THREADS"])
    torch.set_num_threads(threads)
    op_tuning.threads_num(threads)
    ms.set_context(pynative_synchronize=synchronous)
    rng = np.random.default_rng(0)
    a, b = (rng.random(s, dtype=np.float32) for s in SHAPES)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    ma, mb = ms.Tensor(a), ms.Tensor(b)
    custom = ops.Custom(lambda x, y: np.matmul(x, y), out_shape=lambda x, y: (x[0], y[1]),
                        out_dtype=lambda x, y: x, func_type="pyfunc")
    stamps = []
    mark = ops.Custom(lambda x: (stamps.append(time.perf_counter()), x)[1], out_shape=lambda x: x,
                      out_dtype=lambda x: x, func_type="pyfunc")

    def kernel_ms(python_sleeps: bool) -> float:
        """MindSpore's MatMul timed on its runtime thread, between two pyfunc marks around it, while
        the Python thread waits in asnumpy() or sleeps until the step must be done."""
        times = []
        for i in range(reps + 2):
            stamps.clear()
            out = mark(ops.matmul(mark(ma), mb))
            if python_sleeps:
                time.sleep(0.4)
            out.asnumpy()
            if i >= 2:
                times.append((stamps[1] - stamps[0]) * 1000)
        return statistics.median(times)
    return {
        "mindspore MatMul, on its thread, Python waiting in asnumpy": kernel_ms(False),
        "mindspore MatMul, on its thread, Python asleep": kernel_ms(True),
        "numpy": _median_ms(lambda: a @ b, reps),
        "torch": _median_ms(lambda: ta @ tb, reps),
        "mindspore MatMul": _median_ms(lambda: ops.matmul(ma, mb).asnumpy(), reps),
        "numpy on MindSpore tensors (zero-copy)": _median_ms(
            lambda: ms.Tensor.from_numpy(np.matmul(ma.asnumpy(), mb.asnumpy())), reps),
        "numpy as a pyfunc Custom op": _median_ms(lambda: custom(ma, mb).asnumpy(), reps),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--asynchronous", action="store_true", help="MindSpore's default asynchronous dispatch")
    p.add_argument("--child", choices=("free", "pinned"), help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.child:
        print(json.dumps(measure(opts.reps, opts.child == "pinned", not opts.asynchronous)))
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    results = {}
    for key, threads, where in (("1", 1, "free"), ("2", 2, "free"), ("1 pinned", 1, "pinned")):
        env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads), GLOG_v="3")
        out = subprocess.run([sys.executable, __file__, "--child", where, "--reps", str(opts.reps),
                              *(["--asynchronous"] if opts.asynchronous else [])], env=env,
                             capture_output=True, text=True, timeout=600)
        if out.returncode:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        results[key] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"fp32 {SHAPES[0]} x {SHAPES[1]}, median ms, MindSpore's ops "
          f"{'asynchronous' if opts.asynchronous else 'synchronous'}:")
    print("| route | 1 thread | 2 threads | 1 thread, pinned to one core | 1 / 2 |")
    print("|---|---|---|---|---|")
    for route in results["1"]:
        one, two, pinned = results["1"][route], results["2"][route], results["1 pinned"][route]
        print(f"| {route} | {one:.1f} | {two:.1f} | {pinned:.1f} | {one / two:.2f}x |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
