"""Device choice for the mindspore backend (ascend when MindSpore sees one, else cpu), and the
clear error when MindSpore is not installed."""
from __future__ import annotations

import glob
import importlib
import importlib.util
import os

from mindspeed.backends import BackendUnavailableError

INSTALL_HINT = 'pip install mindspore==2.10.0 "numpy<2"'
DEVICE_ENV = "MINDSPEED_DEVICE"
_MS_TARGETS = {"cpu": "CPU", "ascend": "Ascend"}


def quiet_mindspore_logs() -> None:
    """MindSpore's logs (C++ and Python): errors only, unless the user asks (GLOG_v). Read when
    MindSpore is first imported: else its probe for an Ascend device prints four warning lines."""
    os.environ.setdefault("GLOG_v", "3")


def import_mindspore():
    """mindspore, or a BackendUnavailableError that names the install command."""
    quiet_mindspore_logs()
    try:
        return importlib.import_module("mindspore")
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the mindspore backend needs MindSpore, which is not importable ({exc}). "
            f"Install it with: {INSTALL_HINT}  (or run ./auto_convert_llm.sh --backend mindspore)") from exc


def ascend_available(ms) -> bool:
    try:
        return bool(ms.hal.is_available("Ascend"))
    except Exception:   # no CANN / no device plugin: MindSpore raises various errors
        return False


def _no_ascend_device_nodes() -> bool:
    """No Ascend device on this machine: its driver shows each as /dev/davinciN (in containers too)."""
    return not glob.glob("/dev/davinci[0-9]*")


def select_device(requested: str | None = None) -> str:
    requested = (requested or os.environ.get(DEVICE_ENV) or "auto").lower()
    requested = {"npu": "ascend"}.get(requested, requested)
    if requested not in ("auto", "cpu", "ascend"):
        raise ValueError(f"unknown device {requested!r} for the mindspore backend; choose auto, cpu or ascend")
    if (requested == "cpu" or requested == "auto" and _no_ascend_device_nodes()) \
            and importlib.util.find_spec("mindspore") is not None:
        return "cpu"           # known without importing MindSpore (about a CPU-second): the preflight stays light
    ms = import_mindspore()
    if requested == "auto":
        return "ascend" if ascend_available(ms) else "cpu"
    if requested == "ascend" and not ascend_available(ms):
        raise RuntimeError("device 'ascend' was requested but MindSpore sees no Ascend device here")
    return requested


def mindspore_target(device: str) -> str:
    return _MS_TARGETS[device]
