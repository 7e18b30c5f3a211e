"""Kernel dispatch for the mindspore backend: MindSpore's fused op where the device has one
(capabilities.FAST_KERNELS), the MindSpore reference otherwise."""
from __future__ import annotations

import importlib

from mindspeed.backends.base import KernelsAPI
from mindspeed.backends.mindspore.capabilities import FAST_KERNELS

KERNELS = ("rms_norm", "swiglu", "rope", "attention", "ring_attention_update", "gmm",
           "matmul_add_fp32", "moe_permute", "moe_unpermute", "dropout_add_layer_norm")
_FAST_MODULES = {"ascend": "mindspeed.backends.mindspore.kernels.ascend"}


def _delegate(name):
    def method(self, *args, **kwargs):
        return self._impl[name](*args, **kwargs)
    method.__name__ = name
    return method


class _Reference(KernelsAPI):
    def __init__(self):
        module = importlib.import_module("mindspeed.backends.mindspore.kernels.reference")
        self._impl = {name: getattr(module, name) for name in KERNELS}
        self.reference = self

    for _name in KERNELS:
        locals()[_name] = _delegate(_name)


class MsKernels(KernelsAPI):
    def __init__(self, device: str):
        self.device = device
        self.reference = _Reference()
        self._impl = dict(self.reference._impl)
        fast = FAST_KERNELS.get(device, set())
        if fast:
            module = importlib.import_module(_FAST_MODULES[device])
            self._impl.update({name: getattr(module, name) for name in fast})

    def implementation(self, name: str):
        return self._impl[name]

    for _name in KERNELS:
        locals()[_name] = _delegate(_name)
