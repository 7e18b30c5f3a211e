"""Extra cpu shim for Megatron-Core's optimizer/training path (separate from megatron_shim.py so
the lead can fold it in): Megatron checks `tensor.type() == 'torch.cuda.FloatTensor'` in its
optimizers and grad clipping. On cpu, report cpu tensors under the cuda type name while adapted.
Applied by the trainer through the PatchManager, so mindspeed.unadapt() removes it.
"""
from __future__ import annotations

import torch

TARGET = "torch.Tensor.type"


def _wrap_tensor_type(original):
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        return original(self, dtype, non_blocking, **kwargs)
    return type_


def apply_training_cpu_shim(patcher) -> None:
    if patcher.find(TARGET) is None:
        patcher.wrap(TARGET, _wrap_tensor_type,
                     reason="Megatron optimizers check tensor.type() == 'torch.cuda.FloatTensor'")
