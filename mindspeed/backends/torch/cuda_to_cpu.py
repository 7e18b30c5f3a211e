"""device='cuda' -> cpu for a Megatron-Core that names CUDA literally (`torch.zeros(..., device='cuda')`,
`t.cuda()`, `pin_memory=True`), as wrappers on the torch functions and Tensor methods that take a
device.

Wrappers rather than a TorchFunctionMode: a mode runs a Python function on every torch call of the
process, a few microseconds each, about 1,600 calls in one training step of a small model; the
wrappers cost only the calls that can name a device. Unlike a mode (per thread), they hold in every
thread.
"""
from __future__ import annotations

import functools

import torch

# torch functions with a `device` (or `pin_memory`) keyword that Megatron-Core and torch's own
# Python code call
FACTORIES = ("arange", "as_tensor", "asarray", "empty", "empty_like", "empty_permuted", "empty_strided", "eye",
             "full", "full_like", "linspace", "logspace", "normal", "ones", "ones_like", "rand", "rand_like",
             "randint", "randint_like", "randn", "randn_like", "randperm", "range", "scalar_tensor",
             "sparse_coo_tensor", "tensor", "tril_indices", "triu_indices", "zeros", "zeros_like")
TENSOR_FACTORIES = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor", "new_zeros")


def is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _on_cpu(kwargs: dict) -> dict:
    device = kwargs.get("device")
    if device is not None and is_cuda(device):
        kwargs["device"] = "cpu"
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False   # no pinned allocator without an accelerator
    return kwargs


def _factory(original):
    @functools.wraps(original)
    def factory(*args, **kwargs):
        return original(*args, **_on_cpu(kwargs)) if kwargs else original(*args)
    return factory


def _tensor_to(original):
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and is_cuda(args[0]):
            args = ("cpu",) + args[1:]
        return original(self, *args, **_on_cpu(kwargs)) if kwargs else original(self, *args)
    return to


def _stays(original):
    """Tensor.cuda / Tensor.pin_memory: the tensor is already where it will be used."""
    @functools.wraps(original)
    def stays(self, *args, **kwargs):
        return self
    return stays


def apply_cuda_to_cpu(patcher) -> None:
    reason = "device='cuda' / pin_memory -> cpu"
    for name in FACTORIES:
        if hasattr(torch, name):      # a name a future torch drops is simply not wrapped
            patcher.wrap(f"torch.{name}", _factory, reason=reason)
    for name in TENSOR_FACTORIES:
        patcher.wrap(f"torch.Tensor.{name}", _factory, reason=reason)
    patcher.wrap("torch.Tensor.to", _tensor_to, reason=reason)
    patcher.wrap("torch.Tensor.cuda", _stays, reason="tensors are already on the cpu")
    patcher.wrap("torch.Tensor.pin_memory", _stays, reason="no pinned allocator without an accelerator")
