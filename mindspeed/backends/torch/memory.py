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
            return tensor.detach().clone()   # same memory pool: a copy keeps semantics only
        return tensor.detach().to("cpu", non_blocking=True).pin_memory()

    def reload_to_device(self, tensor):
        return tensor.to(self.device, non_blocking=True)

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
