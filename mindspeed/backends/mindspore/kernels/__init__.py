"""Kernel dispatch for the mindspore backend: MindSpore's fused op where the device has one
(capabilities.FAST_KERNELS), the MindSpore reference otherwise."""
from __future__ import annotations

from mindspeed.backends.base import DispatchKernels
from mindspeed.backends.mindspore.capabilities import FAST_KERNELS

_FAST_MODULES = {"ascend": "mindspeed.backends.mindspore.kernels.ascend"}


class MsKernels(DispatchKernels):
    def __init__(self, device: str):
        super().__init__("mindspeed.backends.mindspore.kernels.reference", _FAST_MODULES.get(device),
                         FAST_KERNELS.get(device, set()))
        self.device = device
