"""Recompute, host offload and peak-memory statistics on MindSpore."""
from __future__ import annotations

import resource
import sys

import mindspore as ms

from mindspeed.backends.base import MemoryAPI


class MsMemory(MemoryAPI):
    def __init__(self, device: str):
        self.device = device

    def recompute(self, fn, *args):
        # non-reentrant: fn may be any callable, and Parameters it closes over get gradients
        return ms.recompute(fn, *args, use_reentrant=False)

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
