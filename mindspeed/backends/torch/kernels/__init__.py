"""Kernel dispatch for the torch backend: the device's fast path where catalog.FAST_PATHS has
one, the reference implementation otherwise."""
from __future__ import annotations

import importlib

from mindspeed.backends.base import KernelsAPI
from mindspeed.backends.torch.kernels.catalog import FAST_PATHS, KERNELS

_FAST_MODULES = {"cpu": "mindspeed.backends.torch.kernels.cpu",
                 "cuda": "mindspeed.backends.torch.kernels.cuda",
                 "npu": "mindspeed.backends.torch.kernels.npu"}


def _delegate(name):
    def method(self, *args, **kwargs):
        return self._impl[name](*args, **kwargs)
    method.__name__ = name
    return method


class _Reference(KernelsAPI):
    """The reference implementations, as a KernelsAPI."""

    def __init__(self):
        module = importlib.import_module("mindspeed.backends.torch.kernels.reference")
        self._impl = {name: getattr(module, name) for name in KERNELS}
        self.reference = self

    for _name in KERNELS:
        locals()[_name] = _delegate(_name)


class TorchKernels(KernelsAPI):
    def __init__(self, device: str):
        self.device = device
        self.reference = _Reference()
        self._impl = dict(self.reference._impl)
        fast = FAST_PATHS.get(device, set())
        if fast:
            module = importlib.import_module(_FAST_MODULES[device])
            self._impl.update({name: getattr(module, name) for name in fast})

    def implementation(self, name: str):
        """The callable that serves `name` on this device (for tests and logs)."""
        return self._impl[name]

    for _name in KERNELS:
        locals()[_name] = _delegate(_name)
