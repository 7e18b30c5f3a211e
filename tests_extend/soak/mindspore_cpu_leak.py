"""MindSpore alone (no MindSpeed code): malloc memory kept per call of one op, PyNative on CPU.

    python tests_extend/soak/mindspore_cpu_leak.py [OP ...] [--calls 20000]

For each op: 2,000 warm-up calls, then --calls more; prints the bytes glibc's malloc still has in
use per call afterwards (mallinfo2's uordblks over all arenas). 0 means nothing is kept. Not in CI:
the standalone reproducer of the MindSpore trainer's memory growth (docs/soak.md).
"""
from __future__ import annotations

import argparse
import ctypes

import numpy as np


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def main(argv=None) -> int:
    import mindspore as ms
    from mindspore import ops
    x = ms.Tensor(np.random.default_rng(0).standard_normal((128, 64)).astype(np.float32))
    calls = {"add": lambda: ops.add(x, x).asnumpy(), "relu": lambda: ops.relu(x).asnumpy(),
             "matmul": lambda: ops.matmul(x, x.T).asnumpy(), "softmax": lambda: ops.softmax(x).asnumpy(),
             "mean": lambda: x.mean().asnumpy(), "sum": lambda: x.sum().asnumpy()}
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("ops", nargs="*", help=f"of {sorted(calls)} (default: all)")
    p.add_argument("--calls", type=int, default=20000)
    a = p.parse_args(argv)
    unknown = set(a.ops) - set(calls)
    if unknown:
        p.error(f"unknown ops {sorted(unknown)}: known {sorted(calls)}")
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    print(f"MindSpore {ms.__version__}, PyNative, CPU; bytes of malloc kept per call after {a.calls} calls")
    for name in a.ops or list(calls):
        call = calls[name]
        for _ in range(2000):
            call()
        before = libc.mallinfo2().uordblks
        for _ in range(a.calls):
            call()
        print(f"{name:8s} {(libc.mallinfo2().uordblks - before) / a.calls:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
