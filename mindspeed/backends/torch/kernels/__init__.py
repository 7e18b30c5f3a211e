"""Kernel dispatch for the torch backend: the device's fast path where catalog.FAST_PATHS has
one, the reference implementation otherwise."""
from __future__ import annotations

from mindspeed.backends.base import DispatchKernels
from mindspeed.backends.torch.kernels.catalog import FAST_PATHS


class TorchKernels(DispatchKernels):
    def __init__(self, device: str):
        # imported here, not above: catalog (framework-free, read by the support matrix) lives in
        # this package, and importing it must not import torch
        from mindspeed.backends.torch.kernels import reference
        fast_names = FAST_PATHS.get(device, set())
        super().__init__(reference, _fast_paths_module(device) if fast_names else None, fast_names)
        self.device = device


def _fast_paths_module(device: str):
    """The module of `device`'s fast paths, imported only when that device runs (npu.py imports
    torch_npu)."""
    if device == "cpu":
        from mindspeed.backends.torch.kernels import cpu as module
    elif device == "cuda":
        from mindspeed.backends.torch.kernels import cuda as module
    elif device == "npu":
        from mindspeed.backends.torch.kernels import npu as module
    else:
        raise ValueError(f"torch kernels have no fast paths for device {device!r}")
    return module
