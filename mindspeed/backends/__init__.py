"""Backend registry: the active backend is chosen once (by mindspeed.adapt or a trainer) and
features ask for it with get_backend()."""
from __future__ import annotations

import importlib
import os

from mindspeed.backends.base import Backend, Cap, Level

BACKEND_NAMES = ("torch", "mindspore")
_CLASSES = {
    "torch": "mindspeed.backends.torch.backend:TorchBackend",
    "mindspore": "mindspeed.backends.mindspore.backend:MindSporeBackend",
}
_CAPABILITY_TABLES = {  # framework-free modules: the matrix reads these without importing torch/mindspore
    "torch": "mindspeed.backends.torch.capabilities",
    "mindspore": "mindspeed.backends.mindspore.capabilities",
}
_active: Backend | None = None


class BackendUnavailableError(RuntimeError):
    pass


def capability_table(name: str):
    """The capabilities module of a backend: DEVICES list and declared(device) -> {cap: Level}."""
    return importlib.import_module(_CAPABILITY_TABLES[name])


def backend_class(name: str):
    if name not in _CLASSES:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    module, cls = _CLASSES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def set_backend(name: str | None = None, device: str | None = None) -> Backend:
    """Create and activate a backend. device=None picks the best present device."""
    global _active
    name = name or os.environ.get("MINDSPEED_BACKEND", "torch")
    _active = backend_class(name)(device=device)
    return _active


def get_backend() -> Backend:
    """The active backend; the torch backend on the best device if none was chosen yet."""
    return _active if _active is not None else set_backend()


def reset_backend() -> None:
    global _active
    _active = None


__all__ = ["Backend", "Cap", "Level", "get_backend", "set_backend", "reset_backend", "backend_class",
           "capability_table", "BACKEND_NAMES", "BackendUnavailableError"]
