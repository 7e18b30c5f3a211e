"""The Megatron-Core modules that name device 'cuda' on every training step see a `torch` whose
tensor factories put 'cuda' tensors on the cpu.

The cpu shim's CudaToCpuMode rewrites such calls anywhere, but it runs Python on every torch call
of the process. A training step names 'cuda' in tensor factories of three modules (the schedule's
token count; grad-norm and clipping's dummy overflow buffers; the unfused softmax's causal mask).
Giving those modules this view of torch makes the step rewrite-free, so the trainer can run its
steps without the mode (mode_free_steps): the step costs no Python per op.
Every other attribute is torch's own.
"""
from __future__ import annotations

import types

import torch

#: modules whose code on a training step's path calls torch.<factory>(..., device="cuda")
PER_STEP_CUDA_MODULES = ("megatron.core.pipeline_parallel.schedules", "megatron.core.optimizer.clip_grads",
                         "megatron.core.transformer.utils")
FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like",
             "full_like")


def names_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def device_kwarg_to_cpu(kwargs: dict) -> bool:
    """Turn a `device=` naming cuda in these keyword arguments into the cpu; whether it did."""
    if names_cuda(kwargs.get("device")):
        kwargs["device"] = "cpu"
        return True
    return False


def _on_cpu(factory):
    def make(*args, **kwargs):
        device_kwarg_to_cpu(kwargs)
        return factory(*args, **kwargs)
    make.__name__ = factory.__name__
    return make


class CpuTorchView(types.ModuleType):
    """torch, except that its tensor factories take device='cuda' as the cpu."""

    def __init__(self):
        super().__init__("torch", torch.__doc__)
        for name in FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def apply_cpu_torch_views(patcher) -> None:
    import importlib
    view = CpuTorchView()
    for module in PER_STEP_CUDA_MODULES:
        importlib.import_module(module)
        patcher.replace(f"{module}.torch", view, reason="its per-step tensor factories name 'cuda': cpu here")
