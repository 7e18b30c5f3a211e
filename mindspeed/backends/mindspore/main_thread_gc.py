"""Python's cyclic garbage collection on the main thread only, while MindSpore may run ops.

MindSpore runs `pyfunc` kernels (the shared-memory collectives, the gradient taps) on its runtime
threads, and its C++ glue there creates Python objects (argument tuples, arrays). Python starts an
automatic collection on whichever thread allocates when a threshold is crossed, so one can start on
a runtime thread, before or inside the kernel: cycles holding MindSpore tensors are then freed
there, and their destructors free PyNative autograd graph nodes (CNodes) while the main thread,
outside the GIL, works on graphs too. MindSpore's graph objects are not safe to free concurrently:
glibc reports heap corruption in CNode::~CNode, or the process dies of SIGSEGV (docs/native-crash.md).
So: automatic collections off for the run, and the main thread collects at points it picks (the
approach of Megatron's --manual-gc). What exists when the run starts (modules, the imported
frameworks: a full collection of them takes a second or more) is frozen out of the collections
for the run, so the older generations' collections scan only the run's own objects."""
from __future__ import annotations

import contextlib
import gc

# a young-generation collection at every point, older ones every 10th and 100th (Python's own ratios)
_MIDDLE_EVERY, _OLDEST_EVERY = 10, 100


class MainThreadCollection:
    """`with MainThreadCollection() as gc_point:` ... `gc_point()` between steps, on the main thread."""

    def __init__(self):
        self._points, self._was_on = 0, False

    def __enter__(self):
        self._was_on = gc.isenabled()
        gc.disable()
        gc.freeze()
        return self

    def __call__(self) -> None:
        self._points += 1
        gc.collect(2 if self._points % _OLDEST_EVERY == 0 else 1 if self._points % _MIDDLE_EVERY == 0 else 0)

    def __exit__(self, *exc) -> None:
        gc.collect()
        gc.unfreeze()
        if self._was_on:
            gc.enable()


@contextlib.contextmanager
def ops_without_collection():
    """Around MindSpore work run outside a MainThreadCollection block (a Trainer's steps called
    directly: tests, fine-tuning and evaluation scripts): no automatic collection while the ops run,
    then the young generation, where the work's garbage is, collected on this thread. Inside a
    block, or with the collector off, it changes nothing (the block's gc points collect)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.collect(0)
        gc.enable()
