"""Recompute, host offload and peak-memory statistics on torch."""
from __future__ import annotations

import resource
import sys

import torch
import torch.utils.checkpoint

from mindspeed.backends.base import AutogradAPI, MemoryAPI, RecomputedOutput


class TorchMemory(MemoryAPI):
    def __init__(self, device: str):
        self.device = device

    def recompute(self, fn, *args):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    def recompute_output(self, fn, *args):
        return _OutputRecompute(fn, args)

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


class _RecomputeOutputFn(torch.autograd.Function):
    """fn's forward without a graph (nothing inside fn is saved); only the inputs are saved.
    Backward runs after the handle rebuilt the outputs with a graph: it backpropagates through
    that graph, which also gives gradients to parameters fn closes over (e.g. a norm's weight)."""

    @staticmethod
    def forward(ctx, handle, *args):
        with torch.no_grad():
            out = handle.fn(*args)
        ctx.save_for_backward(*[a if torch.is_tensor(a) else None for a in args])
        ctx.handle = handle
        return out

    @staticmethod
    def backward(ctx, *grads):
        handle = ctx.handle
        inputs, outputs = handle.take_recomputed()
        outs = [o for o in outputs if o.requires_grad]
        torch.autograd.backward(outs, [g for o, g in zip(outputs, grads) if o.requires_grad])
        return (None,) + tuple(x.grad if torch.is_tensor(x) and x.requires_grad else None for x in inputs)


class _OutputRecompute(RecomputedOutput):
    def __init__(self, fn, args):
        self.fn, self._ctx, self._recomputed = fn, None, None
        if not torch.is_grad_enabled():          # no backward (eval): nothing to save or rebuild
            self.output, self._live = fn(*args), False
            return
        self._live = True
        self.output = _RecomputeOutputFn.apply(self, *args)
        self._ctx = self.output.grad_fn

    def _outputs(self):
        return self.output if isinstance(self.output, tuple) else (self.output,)

    def discard(self, consumer_output) -> None:
        if not self._live or not consumer_output.requires_grad:
            return
        for o in self._outputs():
            o.untyped_storage().resize_(0)      # the metadata stays: the consumer's saved tensor
        consumer_output.register_hook(self._rebuild)

    def _rebuild(self, _grad):
        if self._recomputed is not None:
            return
        saved = self._ctx.saved_tensors
        inputs = tuple(x.detach().requires_grad_(x.requires_grad) if torch.is_tensor(x) else x for x in saved)
        with torch.enable_grad():
            fresh = self.fn(*inputs)
        fresh_t = fresh if isinstance(fresh, tuple) else (fresh,)
        with torch.no_grad():                   # refill the freed storage the consumer saved
            for old, new in zip(self._outputs(), fresh_t):
                old.untyped_storage().resize_(new.untyped_storage().size())
                old.untyped_storage().copy_(new.untyped_storage())
        self._recomputed = (inputs, fresh_t)

    def take_recomputed(self):
        if self._recomputed is None:            # never discarded: rebuild only the graph
            self._rebuild(None)
        inputs, outputs = self._recomputed
        self._recomputed, self._ctx, self.fn = (), None, None
        return inputs, outputs


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
