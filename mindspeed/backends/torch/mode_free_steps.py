"""Repeated work (a training step, a decoding step) without the cpu shim's CudaToCpuMode once it is
known to need it not.

The mode runs Python on every torch call: a training step of a small model makes thousands, a
one-token decoding step hundreds, so the mode is a noticeable share of either. Megatron-Core's
per-step code names its device through torch.cuda.current_device() (a replaced function) or, in
the modules cpu_torch_view lists, through factories that put 'cuda' on the cpu, and then asks the
mode for nothing. Which path needs it is not assumed: the first step runs under the mode, and only
when that step made it rewrite nothing do the later ones (the same code path) run with the mode
taken off the stack (tensor subclasses keep their own handling). Steps that did ask for cuda (a
sliding-window mask built on 'cuda' at every step) keep the mode. Elsewhere than on cpu nothing
changes.
"""
from __future__ import annotations

import contextlib
from typing import Callable, TypeVar

import torch
from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

from mindspeed.backends.torch.megatron_shim import CudaToCpuMode

T = TypeVar("T")


@contextlib.contextmanager
def cuda_mode_suspended():
    """The cpu shim's mode off the top of the torch-function mode stack while inside; any other
    mode on top stays (and with it this one: correct, only slower)."""
    if isinstance(_get_current_function_mode(), CudaToCpuMode):
        with _pop_mode_temporarily():
            yield
    else:
        yield


class ModeFreeSteps:
    def __init__(self, device: str):
        self.on_cpu = device == "cpu"
        self.mode_free = False

    def __call__(self, step: Callable[..., T], *args, **kwargs) -> T:
        if self.mode_free:
            with cuda_mode_suspended():
                return step(*args, **kwargs)
        before = CudaToCpuMode.rewrites
        result = step(*args, **kwargs)
        self.mode_free = self.on_cpu and CudaToCpuMode.rewrites == before
        return result
