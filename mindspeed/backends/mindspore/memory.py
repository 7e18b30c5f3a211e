"""Recompute, host offload and peak-memory statistics on MindSpore."""
from __future__ import annotations

import resource
import sys

import mindspore as ms

from mindspore import nn

from mindspeed.backends.base import MemoryAPI, RecomputedOutput


class MsMemory(MemoryAPI):
    def __init__(self, device: str):
        self.device = device

    def recompute(self, fn, *args):
        # non-reentrant: fn may be any callable, and Parameters it closes over get gradients.
        # No early stop: it ends the rerun by raising from inside whatever op saved the last tensor,
        # and when that op is a tensor-parallel collective's gradient tap (a Python Custom op) the
        # exception leaves PyNative's grad stack empty ("input_args_info_stack_ is empty" at TP > 1)
        return ms.recompute(fn, *args, use_reentrant=False, early_stop=False)

    def recompute_output(self, fn, *args):
        """fn's inputs must be tensors (parameters too: pass them in, so their gradients flow)."""
        return _OutputRecompute(fn, args)

    def offload_to_host(self, tensor):
        # asnumpy is a host copy on every device; on cpu it is a real copy in the same RAM (emulated)
        host = tensor.asnumpy().copy()
        self.ledger.hold("host", host, int(host.nbytes))
        return host

    def reload_to_device(self, tensor):
        dev = ms.Tensor(tensor)         # copies the array (a later change to it does not show)
        self.ledger.hold("device", dev, int(tensor.nbytes))
        return dev

    def saved_tensors_hooks(self, pack, unpack):
        return ms.saved_tensors_hooks(pack, unpack)     # PyNative only, which the trainer runs

    def nbytes(self, tensor) -> int:
        return int(tensor.nbytes)

    def is_parameter(self, tensor) -> bool:
        return isinstance(tensor, ms.Parameter)

    def peak_memory_bytes(self) -> int:
        if self.device != "cpu":
            return int(ms.runtime.max_memory_allocated())
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux, bytes on macOS
        return int(rss if sys.platform == "darwin" else rss * 1024)

    def reset_peak_memory(self) -> None:
        if self.device != "cpu":
            ms.runtime.reset_max_memory_allocated()


def _sync():
    # PyNative runs ops asynchronously: the refill below is a storage copy outside that queue, so
    # the recomputed values must exist before it and the copy must land before the consumer's
    # backward reads them (without this, 4 of 5 runs of a probe got a wrong weight gradient)
    from mindspore.common.api import _pynative_executor
    _pynative_executor.sync()


class _RecomputeCell(nn.Cell):
    """fn's forward with a hand-written bprop, so nothing inside fn is saved for backward; the
    bprop recomputes fn once more under a vjp (MindSpore cannot build one in the refill hook)."""

    def __init__(self, handle):
        super().__init__()
        self.handle = handle

    def construct(self, *inputs):
        return self.handle.fn(*inputs)

    def bprop(self, *args):
        inputs, dout = args[:-2], args[-1]
        vjp = self.handle.take_vjp(inputs)
        grads = vjp(dout)
        return grads if isinstance(grads, tuple) else (grads,)


class _OutputRecompute(RecomputedOutput):
    def __init__(self, fn, args):
        self.fn, self._args, self._rebuilt = fn, args, False
        self.output = _RecomputeCell(self)(*args)

    def discard(self, consumer_output) -> None:
        self.output.untyped_storage().resize_(0)    # the consumer's saved tensor keeps its metadata
        consumer_output.register_hook(self._rebuild)

    def _rebuild(self, _grad):
        if self._rebuilt or self.fn is None:
            return
        self._rebuilt = True
        fresh = self.fn(*self._args)     # a vjp here, inside backward, breaks MindSpore's grad graph
        _sync()
        storage = self.output.untyped_storage()
        storage.resize_(fresh.untyped_storage().size())
        storage.copy_(fresh.untyped_storage())
        _sync()

    def take_vjp(self, inputs):
        vjp = ms.vjp(self.fn, *inputs)[1]
        self.fn = self._args = None
        return vjp
