"""The torch backend: PyTorch on npu (torch_npu), cuda or cpu, driving Megatron-Core."""
from __future__ import annotations

from mindspeed.backends.base import Backend
from mindspeed.backends.torch import capabilities
from mindspeed.backends.torch.comm import TorchComm
from mindspeed.backends.torch.device import TorchDevice, select_device
from mindspeed.backends.torch.kernels import TorchKernels
from mindspeed.backends.torch.memory import TorchAutograd, TorchMemory
from mindspeed.backends.torch.profiler import TorchProfiler
from mindspeed.backends.torch.tensors import TorchTensors


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, device: str | None = None):
        device_name = select_device(device)
        self.device = TorchDevice(device_name)
        self.comm = TorchComm()
        self.kernels = TorchKernels(device_name)
        self.tensors = TorchTensors()
        self.autograd = TorchAutograd()
        self.memory = TorchMemory(device_name)

    def profiler(self, save_path, **options):
        return TorchProfiler(self.device.name, save_path, **options)

    @classmethod
    def declared_capabilities(cls, device: str):
        return capabilities.declared(device)

    @classmethod
    def devices(cls):
        return list(capabilities.DEVICES)
