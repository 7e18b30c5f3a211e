"""Megatron-Core's NVTX ranges on a torch built without CUDA: torch's profiler ranges instead.

Megatron marks ranges with `torch.cuda.nvtx.range_push` / `range_pop` (`--nvtx-ranges`,
`nvtx_range_push`, activation offloading) and decorates functions with the `nvtx` package's
`annotate` (`nvtx_decorator`). A CPU build of torch has no NVTX (`NVTX functions not installed`),
and without the `nvtx` package Megatron's `utils.nvtx` is unbound (NameError). Both are profiler
annotations: here each range is a `torch.profiler.record_function` range, which torch's profiler
records on the CPU (and MindSpeed's --profile traces show), with NVTX's push/pop depths.
"""
from __future__ import annotations

import functools
import threading
import types

import torch

NVTX = "torch.cuda.nvtx"
_open = threading.local()      # NVTX's range stack is per thread


def _stack() -> list:
    if not hasattr(_open, "ranges"):
        _open.ranges = []
    return _open.ranges


def range_push(msg) -> int:
    """Open a profiler range; its zero-based depth, as NVTX returns."""
    scope = torch.profiler.record_function(str(msg))
    scope.__enter__()
    _stack().append(scope)
    return len(_stack()) - 1


def range_pop() -> int:
    """Close the innermost range; its depth, or -1 when none is open (NVTX's answer)."""
    if not _stack():
        return -1
    _stack().pop().__exit__(None, None, None)
    return len(_stack())


def mark(msg) -> None:
    with torch.profiler.record_function(str(msg)):
        pass


def annotate(message=None, color=None, domain=None, category=None, **kwargs):
    """The `nvtx` package's `annotate(...)` as a decorator: the function runs in a profiler range
    named `message` (the function's name when None; colours mean nothing to torch's profiler)."""
    def decorator(func):
        @functools.wraps(func)
        def ranged(*args, **inner_kwargs):
            with torch.profiler.record_function(message or func.__qualname__):
                return func(*args, **inner_kwargs)
        return ranged
    return decorator


def nvtx_package_standin() -> types.ModuleType:
    module = types.ModuleType("nvtx")
    module.__doc__ = "MindSpeed stand-in for the nvtx package: torch profiler ranges (nvtx_ranges.py)"
    module.annotate, module.push_range, module.pop_range, module.mark = annotate, range_push, range_pop, mark
    return module


def apply_profiler_nvtx(patcher) -> int:
    """NVTX's functions as profiler ranges where torch has no NVTX, and Megatron's `utils.nvtx` where
    the package is absent; the count of patches applied."""
    applied = 0
    if not hasattr(torch._C, "_nvtx"):
        for name, standin in (("range_push", range_push), ("range_pop", range_pop), ("mark", mark)):
            patcher.replace(f"{NVTX}.{name}", standin, reason="torch without NVTX: its ranges are profiler ranges")
            applied += 1
    import megatron.core.utils as utils
    if not hasattr(utils, "nvtx"):
        patcher.define("megatron.core.utils.nvtx", nvtx_package_standin(),
                       reason="nvtx package absent: Megatron's nvtx_decorator annotates with profiler ranges")
        applied += 1
    return applied
