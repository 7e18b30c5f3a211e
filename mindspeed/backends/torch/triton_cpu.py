"""Megatron-Core's Triton kernels on a CPU, through Triton's own interpreter.

Megatron decorates its Triton kernels (the MoE dispatcher's multihot conversion and routing-map
padding, among others) with `triton.jit` while its modules are imported; with TRITON_INTERPRET=1
set by then, Triton's interpreter runs each kernel on CPU tensors (numpy underneath), giving the
kernel's own results. Without triton installed Megatron falls back to a no-op decorator and those
kernels cannot be called at all (a `_GeneratorContextManager` is not subscriptable).

Imports neither torch nor Megatron: it must run before Megatron is imported. A value the user set
is kept.
"""
from __future__ import annotations

import importlib.util
import os

INTERPRET = "TRITON_INTERPRET"


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpret_triton_on_cpu(patcher, device: str) -> bool:
    """Set TRITON_INTERPRET=1 (a patch: listed, undone by unadapt) on a CPU with triton installed.
    True when it is set now."""
    if device != "cpu" or INTERPRET in os.environ or not triton_installed():
        return False
    patcher.setenv(INTERPRET, "1", reason="Megatron-Core's Triton kernels run through Triton's CPU "
                   "interpreter (set before Megatron decorates them at import)")
    return True
