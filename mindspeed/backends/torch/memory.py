"""Recompute, host offload and peak-memory statistics on torch."""
from __future__ import annotations

import resource
import sys

import torch
import torch.utils.checkpoint

from mindspeed.backends.base import AutogradAPI, MemoryAPI


class TorchMemory(MemoryAPI):
    def __init__(self, device: str):
        self.device = device

    def recompute(self, fn, *args):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    def offload_to_host(self, tensor):
        if self.device == "cpu":
            host = tensor.detach().clone()   # same RAM: a real copy, so the ledger counts real bytes
        else:   # pinned, so the copy is asynchronous; copy_ keeps stream order (no read before it lands)
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor.detach(), non_blocking=True)
        self.ledger.hold("host", host, self.nbytes(host))
        return host

    def reload_to_device(self, tensor):
        dev = tensor.clone() if self.device == "cpu" else tensor.to(self.device, non_blocking=True)
        self.ledger.hold("device", dev, self.nbytes(dev))
        return dev

    def saved_tensors_hooks(self, pack, unpack):
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def view_of(self, tensor):
        base = tensor._base
        if base is None or not base.is_contiguous():   # copies keep a contiguous base's layout only
            return tensor, None
        return base, (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset() - base.storage_offset())

    def make_view(self, base, recipe):
        return base.as_strided(*recipe)

    # in-place swap of a tensor that must keep its identity (optimizer states are keyed by it)
    def release_to_host(self, tensor):
        """Copy tensor to the host and free its device storage (tensor keeps shape and dtype)."""
        host = self.offload_to_host(tensor)
        tensor.untyped_storage().resize_(0)
        self.ledger.adjust("device", -self.nbytes(tensor))
        return host

    def restore_from_host(self, tensor, host) -> None:
        """Give tensor its device storage back, filled from host."""
        tensor.untyped_storage().resize_(self.nbytes(tensor))
        tensor.copy_(host, non_blocking=self.device != "cpu")
        self.ledger.adjust("device", self.nbytes(tensor))

    @staticmethod
    def resident(tensor) -> bool:
        return tensor.untyped_storage().nbytes() > 0

    def _accel(self):
        return {"cuda": torch.cuda, "npu": getattr(torch, "npu", None)}.get(self.device)

    def peak_memory_bytes(self) -> int:
        if self._accel() is not None:
            return int(self._accel().max_memory_allocated())
        # cpu: the process's peak resident set (ru_maxrss is KiB on Linux, bytes on macOS)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)

    def reset_peak_memory(self) -> None:
        if self._accel() is not None:
            self._accel().reset_peak_memory_stats()


class _Ctx:
    """What custom_op's forward/backward receive: saved tensors plus free attributes."""

    def __init__(self, torch_ctx):
        self._torch_ctx = torch_ctx

    def save(self, *tensors):
        self._torch_ctx.save_for_backward(*tensors)

    @property
    def saved(self):
        return self._torch_ctx.saved_tensors


class TorchAutograd(AutogradAPI):
    def custom_op(self, forward, backward):
        class _Op(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                if not hasattr(ctx, "ms_ctx"):
                    ctx.ms_ctx = _Ctx(ctx)
                return forward(ctx.ms_ctx, *inputs)

            @staticmethod
            def backward(ctx, *grads):
                return backward(ctx.ms_ctx, *grads)

        _Op.__name__ = getattr(forward, "__name__", "custom_op")
        return _Op.apply
