"""Kernel dispatch for the mindspore backend: MindSpore's fused op where the device has one
(capabilities.FAST_KERNELS), the MindSpore reference otherwise."""
from __future__ import annotations

from mindspeed.backends.base import DispatchKernels
from mindspeed.backends.mindspore.capabilities import FAST_KERNELS


class MsKernels(DispatchKernels):
    def __init__(self, device: str):
        # imported here, not above: the modules import MindSpore, which the backend imports first
        # (backend.py: import_mindspore quiets its logs)
        from mindspeed.backends.mindspore.kernels import reference
        fast_names = FAST_KERNELS.get(device, set())
        super().__init__(reference, _fast_paths_module(device) if fast_names else None, fast_names)
        self.device = device

    def attention(self, q, k, v, *, drop_mask=None, **options):
        """KernelsAPI.attention (`options` are its keywords). The MindSpore reference also takes
        `drop_mask`, the caller's own dropout of the probabilities (training/mindspore/model.py
        passes it to `reference.attention`); the fused op has none."""
        if drop_mask is None:
            return super().attention(q, k, v, **options)
        return self.implementation("attention")(q, k, v, drop_mask=drop_mask, **options)


def _fast_paths_module(device: str):
    """The module of `device`'s fused ops, imported only when that device runs."""
    if device == "ascend":
        from mindspeed.backends.mindspore.kernels import ascend as module
    else:
        raise ValueError(f"mindspore kernels have no fast paths for device {device!r}")
    return module
