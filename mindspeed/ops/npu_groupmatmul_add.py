"""Upstream's `mindspeed.ops.npu_groupmatmul_add` module: a grouped GEMM's weight gradient
accumulated into an fp32 buffer (the gmm counterpart of npu_matmul_add_fp32).

    from mindspeed.ops.npu_groupmatmul_add import npu_groupmatmul_add_fp32
"""
from __future__ import annotations

from mindspeed.backends import backend_for

__all__ = ["npu_groupmatmul_add_fp32"]


def npu_groupmatmul_add_fp32(x, dy, grouplist, grad):
    """In place grad[g] += x_g^T @ dy_g in fp32 -> grad. x [M, K] and dy [M, N] have their rows
    sorted by group; grouplist holds the groups' cumulative row ends (as npu_gmm's); grad is float32
    with G*K*N values, read as [G, K, N] (e.g. a [G*K, N] main_grad of gmm's weight [G, K, N])."""
    return backend_for(x).kernels.grouped_matmul_add_fp32(x, dy, grouplist, grad, 0)
