"""Repeated work (a decoding step) without the cpu shim's CudaToCpuMode once it is known to need it not.

The mode runs Python on every torch call; a one-token decoding step of a small model makes hundreds,
so the mode is a large share of the step's time though Megatron-Core's decode path names its device
through torch.cuda.current_device() (a replaced function) and asks the mode for nothing. Which path
needs it is not assumed: the first step runs under the mode, and only when that step made it rewrite
nothing do the later ones (the same code path, one position further) run with torch-function
handling off (no mode, no tensor-subclass hooks). Steps that did ask for cuda (a sliding-window mask
is built on 'cuda' at every step) keep the mode. Elsewhere than on cpu nothing changes.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from mindspeed.backends.torch.megatron_shim import CudaToCpuMode

T = TypeVar("T")


class ModeFreeSteps:
    def __init__(self, device: str):
        self.on_cpu = device == "cpu"
        self.mode_free = False

    def __call__(self, step: Callable[..., T], *args) -> T:
        if self.mode_free:
            with torch._C.DisableTorchFunction():
                return step(*args)
        before = CudaToCpuMode.rewrites
        result = step(*args)
        self.mode_free = self.on_cpu and CudaToCpuMode.rewrites == before
        return result
