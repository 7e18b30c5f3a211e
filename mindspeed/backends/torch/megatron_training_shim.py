"""What Megatron-LM's own training package (`megatron.training`, `megatron.legacy`) assumes about
CUDA, mapped to the CPU. Applied on top of the Megatron-Core shim (megatron_shim.py) when the
user runs Megatron-LM's `pretrain_gpt.py` with `import mindspeed.megatron_adaptor`.

Each item was found by running Megatron-LM core_v0.12.1 and core_v0.16.1 on CPU/gloo; every one
goes through the patch manager, so `describe()` lists it and `unadapt()` removes it.
Must be applied before `megatron.training` is imported (the triton-only module is imported by it).
"""
from __future__ import annotations

import importlib
import importlib.util
import types

import torch

BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _batch_invariant_stand_in() -> types.ModuleType:
    module = types.ModuleType(BATCH_INVARIANT)

    def enable_batch_invariant_mode(*args, **kwargs):
        raise RuntimeError("--batch-invariant-mode needs triton (GPU kernels), which this machine lacks")

    module.enable_batch_invariant_mode = enable_batch_invariant_mode
    module.__doc__ = "MindSpeed stand-in: the real module imports triton, absent on this device"
    return module


def _needs_batch_invariant_stand_in() -> bool:
    """core_v0.16 imports a triton-only module from megatron.training.initialize."""
    try:
        if importlib.util.find_spec(BATCH_INVARIANT) is None:
            return False          # older Megatron: no such module
    except ModuleNotFoundError:
        return False
    return importlib.util.find_spec("triton") is None


def _wrap_initialize_megatron(original):
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True    # its first line asserts torch.cuda.is_available()
        return original(*args, **kwargs)
    return initialize_megatron


def _one_device() -> int:
    # Megatron only builds its model-parallel groups and seeds its RNG tracker when
    # device_count() > 0; on CPU each process owns one "device".
    return 1


def apply_cpu_training_shim(patcher) -> None:
    if _needs_batch_invariant_stand_in():
        patcher.provide_module(BATCH_INVARIANT, _batch_invariant_stand_in(),
                               reason="its triton import fails on CPU (--batch-invariant-mode is refused)")
    patcher.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1",
                   reason="Megatron asserts it for TP/CP (a CUDA scheduling knob; meaningless on CPU)")
    importlib.import_module("megatron.training")   # everything below must exist now
    patcher.wrap("megatron.training.initialize.initialize_megatron", _wrap_initialize_megatron,
                 reason="allow_no_cuda: the CPU is the device", aliases="megatron")
    patcher.replace("torch.cuda.device_count", _one_device,
                    reason="Megatron builds parallel groups and seeds only when device_count() > 0")
    patcher.replace("torch.cuda.set_device", lambda *a, **k: None, reason="one CPU device per process")
    utils = importlib.import_module("megatron.training.utils")
    if hasattr(utils, "get_device_arch_version"):
        patcher.replace("megatron.training.utils.get_device_arch_version", lambda: 0,
                        reason="no CUDA compute capability on CPU", aliases="megatron")
    patcher.replace("torch.cuda.get_device_capability", lambda *a, **k: (8, 0),
                    reason="validate_args checks sm>=8 for --moe-grouped-gemm; MindSpeed's gmm kernel serves it")
    patcher.replace("megatron.legacy.fused_kernels.load", lambda *a, **k: None,
                    reason="legacy CUDA softmax kernels are not built on CPU", aliases="megatron")
    if hasattr(importlib.import_module("megatron.training.initialize"), "_warmup_jit_function"):
        patcher.replace("megatron.training.initialize._warmup_jit_function", lambda: None,
                        reason="the fusions compile on their first call anyway; the warmup also compiles "
                               "variants the model may never call (with a bias under --disable-bias-linear) "
                               "and never runs their backward, so no start finds them cached",
                        aliases="megatron")
