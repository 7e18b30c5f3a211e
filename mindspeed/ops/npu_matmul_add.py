"""Upstream's `mindspeed.ops.npu_matmul_add` module: a linear layer's weight gradient accumulated
into an fp32 buffer (Megatron's gradient-accumulation fusion).

    from mindspeed.ops.npu_matmul_add import npu_matmul_add_fp32
"""
from __future__ import annotations

from mindspeed.backends import backend_for

__all__ = ["npu_matmul_add_fp32"]


def npu_matmul_add_fp32(total_input, grad_output, grad):
    """In place grad += grad_output^T @ total_input in fp32 -> grad. total_input [..., K] and
    grad_output [..., N] (leading dims flattened, equal row counts); grad float32 [N, K]."""
    return backend_for(total_input).kernels.matmul_add_fp32(total_input, grad_output, grad)
