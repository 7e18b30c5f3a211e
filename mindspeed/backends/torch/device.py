"""Device selection for the torch backend: npu (only when torch_npu imports) > cuda > cpu.

Override with `--device` or MINDSPEED_DEVICE. torch_npu is imported here and nowhere else at
module level, and only when asked for or when auto-detecting.
"""
from __future__ import annotations

import importlib

import torch

from mindspeed.backends.base import DeviceAPI
from mindspeed.backends.torch.device_select import requested_device


def npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except Exception:   # torch_npu raises more than ImportError without CANN
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def select_device(requested: str | None = None) -> str:
    requested = requested_device(requested)
    if requested == "auto":
        if npu_available():
            return "npu"
        return "cuda" if torch.cuda.is_available() else "cpu"
    checks = {"cpu": lambda: True, "cuda": torch.cuda.is_available, "npu": npu_available}
    if requested not in checks:
        raise ValueError(f"unknown device {requested!r}; choose auto, cpu, cuda or npu")
    if not checks[requested]():
        raise RuntimeError(f"device {requested!r} was requested but is not available on this machine"
                           + (" (torch_npu did not import or no NPU is visible)" if requested == "npu" else ""))
    return requested


def dist_backend_for(device: str) -> str:
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device]


class TorchDevice(DeviceAPI):
    def __init__(self, name: str):
        self.name = name
        self.torch_device = torch.device(name)

    def _module(self):
        return {"cuda": torch.cuda, "npu": getattr(torch, "npu", None)}.get(self.name)

    def synchronize(self) -> None:
        if self._module() is not None:
            self._module().synchronize()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self._module() is not None:
            self._module().manual_seed(seed)

    def get_rng_state(self):
        mod = self._module()
        return mod.get_rng_state() if mod is not None else torch.get_rng_state()

    def set_rng_state(self, state) -> None:
        mod = self._module()
        (mod.set_rng_state if mod is not None else torch.set_rng_state)(state)

    def side_stream(self):
        """CPU has no second stream: a worker thread stands in (one per device object, made on first use)."""
        if self.name != "cpu":
            return None
        if getattr(self, "_side", None) is None:
            from mindspeed.backends.torch.side_stream import SideStream
            self._side = SideStream("comm")
        return self._side
