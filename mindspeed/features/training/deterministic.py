"""--npu-deterministic (MindSpeed's name): bitwise-repeatable runs on any device, not only NPUs.

It turns on Megatron's --deterministic-mode, which both built-in trainers honour (torch:
deterministic algorithms and Megatron-Core's deterministic_mode; MindSpore: mindspore's
deterministic kernels, a switch that can be set only once per process, so only the trainer sets
it), and adds what that flag leaves to the launcher: on the torch backend the deterministic switch
itself (a Megatron-LM host reads --deterministic-mode only for Megatron-Core's config), cuDNN's
deterministic algorithms, cuBLAS's fixed workspace on CUDA, HCCL's deterministic reductions on
Ascend, and Python's and NumPy's global seeds. unadapt() undoes all of it but the seeds.
"""
from __future__ import annotations

import random

from mindspeed.features.base import Feature, switch
from mindspeed.features.registry import register

# environment the device's libraries read when they start (cuBLAS handles, HCCL communicators);
# the features are applied before the trainer creates either
DEVICE_ENV = {"cuda": ("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),     # cuBLAS's deterministic workspace
              "npu": ("HCCL_DETERMINISTIC", "true"), "ascend": ("HCCL_DETERMINISTIC", "true")}


class TorchDeterministic:
    """torch's deterministic switches as a context the patcher enters; exit restores them."""

    def __enter__(self):
        import torch
        self._previous = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                          torch.backends.cudnn.benchmark)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        return self

    def __exit__(self, *exc):
        import torch
        algorithms, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = self._previous
        torch.use_deterministic_algorithms(algorithms)


@register
class NpuDeterministic(Feature):
    id = "npu-deterministic"
    category = "training"
    optimization_level = 0
    description = "deterministic kernels and collectives, seeded: bitwise-identical losses run to run"
    flags = (switch("--npu-deterministic", "deterministic algorithms on the device (any device): runs with "
                                           "the same --seed give bitwise-identical losses"),)
    example = ("--npu-deterministic",)
    host_flags = {"deterministic_mode": True}

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            ctx.patcher.enter("torch deterministic algorithms", TorchDeterministic(),
                              reason="--npu-deterministic")
        if ctx.device in DEVICE_ENV:
            ctx.patcher.setenv(*DEVICE_ENV[ctx.device], reason="--npu-deterministic")
        random.seed(args.seed)
        try:
            import numpy
            numpy.random.seed(args.seed)
        except ImportError:
            pass
