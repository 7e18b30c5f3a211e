"""Is `import torch` MindSpore underneath? (an MSAdapter / mindtorch checkout first on PYTHONPATH)

Users run Megatron code on MindSpore with `export PYTHONPATH=MSAdapter/mindtorch:MindSpeed`.
Then the `torch` package is MSAdapter's, and the mindspore backend must serve kernels and
collectives. Detection looks at where `torch` resolves and what its package says about itself,
without importing it (importing the real torch takes seconds; importing MSAdapter pulls MindSpore).
"""
from __future__ import annotations

import importlib.util
import os
import sys

_MARKERS = ("mindtorch", "msadapter")
_SOURCE_PEEK_BYTES = 16384


def torch_origin() -> str | None:
    """Path of the `torch` package's __init__.py that `import torch` uses, or None."""
    mod = sys.modules.get("torch")
    if mod is not None and getattr(mod, "__file__", None):
        return mod.__file__
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def _mentions_mindspore(init_path: str) -> bool:
    try:
        with open(init_path, "r", encoding="utf-8", errors="ignore") as f:
            head = f.read(_SOURCE_PEEK_BYTES)
    except OSError:
        return False
    return "mindspore" in head or "mindtorch" in head


def msadapter_active() -> bool:
    """True when `import torch` resolves to an MSAdapter/mindtorch package."""
    origin = torch_origin()
    if not origin:
        return False
    parts = [p.lower() for p in os.path.normpath(origin).split(os.sep)]
    if any(m in p for p in parts[:-1] for m in _MARKERS):
        return True
    return _mentions_mindspore(origin)


def describe() -> str:
    """One line for logs: which `torch` is in use and what that means for the backend."""
    origin = torch_origin()
    if origin is None:
        return "torch: not importable; the mindspore backend runs MindSpeed's native MindSpore trainer"
    if msadapter_active():
        return (f"torch resolves to MSAdapter ({os.path.dirname(origin)}): MindSpore runs underneath, "
                f"the mindspore backend serves kernels and collectives")
    return f"torch resolves to PyTorch ({os.path.dirname(origin)}); MSAdapter is not active"
