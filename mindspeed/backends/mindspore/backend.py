"""The mindspore backend: MindSpore (PyNative) on Ascend or CPU, driving MindSpeed's native
MindSpore GPT trainer (mindspeed/training/mindspore)."""
from __future__ import annotations

from mindspeed.backends.base import Backend
from mindspeed.backends.mindspore import capabilities
from mindspeed.backends.mindspore.device_select import import_mindspore, select_device


class MindSporeBackend(Backend):
    name = "mindspore"

    def __init__(self, device: str | None = None):
        import_mindspore()     # a clear install message before anything else
        from mindspeed.backends.mindspore.autograd import MsAutograd
        from mindspeed.backends.mindspore.comm import MsComm
        from mindspeed.backends.mindspore.device import MsDevice
        from mindspeed.backends.mindspore.kernels import MsKernels
        from mindspeed.backends.mindspore.memory import MsMemory
        from mindspeed.backends.mindspore.tensors import MsTensors
        device_name = select_device(device)
        self.device = MsDevice(device_name)
        self.comm = MsComm(device_name)
        self.kernels = MsKernels(device_name)
        self.tensors = MsTensors()
        self.autograd = MsAutograd()
        self.memory = MsMemory(device_name)

    def profiler(self, save_path, **options):
        from mindspeed.backends.mindspore.profiler import MsProfiler
        return MsProfiler(self.device.name, save_path, **options)

    @classmethod
    def declared_capabilities(cls, device: str):
        return capabilities.declared(device)

    @classmethod
    def devices(cls):
        return list(capabilities.DEVICES)
