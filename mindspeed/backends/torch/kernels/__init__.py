"""Kernel dispatch for the torch backend: the device's fast path where catalog.FAST_PATHS has
one, the reference implementation otherwise."""
from __future__ import annotations

from mindspeed.backends.base import DispatchKernels
from mindspeed.backends.torch.kernels.catalog import FAST_PATHS

_FAST_MODULES = {"cpu": "mindspeed.backends.torch.kernels.cpu",
                 "cuda": "mindspeed.backends.torch.kernels.cuda",
                 "npu": "mindspeed.backends.torch.kernels.npu"}


class TorchKernels(DispatchKernels):
    def __init__(self, device: str):
        super().__init__("mindspeed.backends.torch.kernels.reference", _FAST_MODULES.get(device),
                         FAST_PATHS.get(device, set()))
        self.device = device
