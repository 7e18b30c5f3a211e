"""The torch backend's device, answered without importing torch where the installed build leaves one
answer: a CPU-only torch wheel (its version.py names no CUDA, ROCm or XPU build) without torch_npu runs
on the CPU only. The launch scripts' preflight and `python -m mindspeed check` then start in a fraction of
a second instead of importing torch (about a CPU-second) to ask torch.cuda.is_available()."""
from __future__ import annotations

import ast
import importlib.util
import os

DEVICE_ENV = "MINDSPEED_DEVICE"
_ACCELERATOR_BUILDS = ("cuda", "hip", "rocm", "xpu")   # torch/version.py's fields naming a GPU build


def names_no_accelerator(version_source: str) -> bool:
    """Whether torch's version.py (its text) says a CPU-only build: `cuda` and `hip` set to None, and
    every other accelerator field it has. False when the text says otherwise or cannot be read."""
    try:
        tree = ast.parse(version_source)
    except (SyntaxError, ValueError):
        return False
    values = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else \
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and node.value is not None:
            values[target.id] = node.value
    if not {"cuda", "hip"} <= set(values):
        return False
    return all(isinstance(values[name], ast.Constant) and values[name].value is None
               for name in _ACCELERATOR_BUILDS if name in values)


def _torch_spec():
    spec = importlib.util.find_spec("torch")
    return spec if spec is not None and spec.submodule_search_locations else None


def cpu_only_torch() -> bool:
    """The installed torch can run on the CPU only (and is installed): no accelerator build, no torch_npu."""
    spec = _torch_spec()
    if spec is None or importlib.util.find_spec("torch_npu") is not None:
        return False
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
            return names_no_accelerator(f.read())
    except OSError:
        return False


def requested_device(requested: str | None) -> str:
    """What the user asked for: --device, else $MINDSPEED_DEVICE, else auto (lower case)."""
    return (requested or os.environ.get(DEVICE_ENV) or "auto").lower()


def device_without_torch(requested: str | None) -> str | None:
    """'cpu' where that is what torch's own selection (device.select_device) would answer for `requested`
    on this install; None where only torch can answer."""
    choice = requested_device(requested)
    if choice == "cpu" and _torch_spec() is not None or choice == "auto" and cpu_only_torch():
        return "cpu"
    return None
