"""The mindspore backend: MindSpore (PyNative) on Ascend or CPU, driving MindSpeed's native
MindSpore GPT trainer (mindspeed/training/mindspore)."""
from __future__ import annotations

from mindspeed.backends.base import Backend
from mindspeed.backends.mindspore import capabilities
from mindspeed.backends.mindspore.device_select import import_mindspore, select_device
from mindspeed.backends.mindspore.profiler import MsProfiler


class MindSporeBackend(Backend):
    name = "mindspore"

    def __init__(self, device: str | None = None):
        import_mindspore()     # a clear install message (and GLOG_v) before anything else
        from mindspeed.backends.mindspore import (  # these import MindSpore: after import_mindspore()
            autograd, comm, device as ms_device, kernels, memory, tensors)
        device_name = select_device(device)
        self.device = ms_device.MsDevice(device_name)
        self.comm = comm.MsComm(device_name)
        self.kernels = kernels.MsKernels(device_name)
        self.tensors = tensors.MsTensors()
        self.autograd = autograd.MsAutograd()
        self.memory = memory.MsMemory(device_name)

    def profiler(self, save_path, **options):
        return MsProfiler(self.device.name, save_path, **options)

    @classmethod
    def declared_capabilities(cls, device: str):
        return capabilities.declared(device)

    @classmethod
    def devices(cls):
        return list(capabilities.DEVICES)
