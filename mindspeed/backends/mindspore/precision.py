"""bf16 on MindSpore: which devices compute it natively, and the fp32 path for the ops whose bf16
kernel a device lacks.

MindSpore 2.10 on CPU (measured; tests_extend/unit/test_mindspore_bf16.py checks the list): op by
op (PyNative) it has bf16 kernels for Cast, Add, Sub, Mul, Div, Neg, Reshape, Transpose, Concat,
Split, StridedSlice, BroadcastTo and Tensor.copy_, and the reference kernels (RMSNorm, SwiGLU,
RoPE, attention) already compute in fp32 inside; it has none for MISSING_ON_CPU. Traced graphs
also lack bf16 Reshape, AddN and SumExt, so a bf16 model runs op by op there. An op in the list
takes its bf16 inputs upcast to fp32 and rounds its output to bf16 once (`fp32_compute`): bf16
storage, fp32 arithmetic, as torch's CPU bf16 kernels accumulate in fp32. On Ascend bf16 kernels
exist, so nothing is upcast there.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import ops

MISSING_ON_CPU = ("MatMul", "BatchMatMul", "Gather", "Softmax", "Sigmoid", "Exp", "Sqrt", "ReduceSum",
                  "LayerNorm", "Assign")


def emulated() -> bool:
    """True where bf16 arithmetic is upcast to fp32 (MindSpore's CPU target)."""
    return ms.get_context("device_target") == "CPU"


def _is_bf16(value) -> bool:
    return isinstance(value, ms.Tensor) and value.dtype == ms.bfloat16


def _up(value):
    return value.astype(ms.float32) if _is_bf16(value) else value


def _down(value):
    if isinstance(value, tuple):
        return tuple(_down(v) for v in value)
    return value.astype(ms.bfloat16) if isinstance(value, ms.Tensor) and value.dtype == ms.float32 else value


def fp32_compute(fn):
    """fn on bf16 tensors where the device lacks its bf16 kernel: every bf16 tensor argument upcast,
    fp32 outputs rounded to bf16 when the first argument was bf16 (the activation's dtype rules; a
    bf16 weight meeting fp32 activations, as inside an fp32 MoE layer, gives fp32)."""
    def run(*args, **kwargs):
        if not any(_is_bf16(a) for a in (*args, *kwargs.values())) or not emulated():
            return fn(*args, **kwargs)
        out = fn(*(_up(a) for a in args), **{k: _up(v) for k, v in kwargs.items()})
        return _down(out) if _is_bf16(args[0]) else out
    return run


def assign(param, value) -> None:
    """param := value in place (a traced graph holds the storage): CPU's Assign has no bf16 kernel,
    Tensor.copy_ has."""
    if param.dtype == ms.bfloat16:
        param.copy_(value)
    else:
        ops.assign(param, value)
