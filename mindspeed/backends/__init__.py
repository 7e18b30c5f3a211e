"""Backend registry: the active backend is chosen once (by mindspeed.adapt or a trainer). Features
receive it through the session (ApplyContext.backend, Session.backend), never from here."""
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
_by_tensor: dict = {}    # framework -> backend made for a tensor of it while none of its kind was active


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


NO_BACKEND = ("no MindSpeed backend is active: call mindspeed.adapt(args) (or "
              "mindspeed.backends.set_backend('torch' | 'mindspore')) first")


def get_backend() -> Backend:   # for this package and code outside features with no session at hand
    """The active backend. None chosen yet is an error: nothing is built behind the caller's back."""
    if _active is None:
        raise BackendUnavailableError(NO_BACKEND)
    return _active


def active_backend() -> Backend | None:
    """The active backend, or None: whether something adapted this process."""
    return _active


def framework_of(tensor) -> str | None:
    """'torch' or 'mindspore' for a tensor of that framework (MSAdapter's torch tensors are
    MindSpore's), else None."""
    for cls in type(tensor).__mro__:
        root = cls.__module__.split(".")[0]
        if root in _CLASSES:
            return root
    return None


def backend_for(tensor) -> Backend:
    """The backend of the framework `tensor` belongs to: the active one when it is that framework's,
    else that framework's backend on the best device (made once, not activated)."""
    name = framework_of(tensor)
    if name is None:
        raise BackendUnavailableError(f"a {type(tensor).__name__} is not a torch or MindSpore tensor; "
                                      "MindSpeed's ops take the tensors of a framework it has a backend for")
    if _active is not None and _active.name == name:
        return _active
    if name not in _by_tensor:
        _by_tensor[name] = backend_class(name)(device=None)
    return _by_tensor[name]


def reset_backend() -> None:
    global _active
    _active = None
    _by_tensor.clear()


__all__ = ["Backend", "Cap", "Level", "get_backend", "active_backend", "backend_for", "framework_of", "set_backend", "reset_backend",
           "backend_class",
           "capability_table", "BACKEND_NAMES", "BackendUnavailableError"]
