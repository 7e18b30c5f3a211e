"""Upstream's `mindspeed.ops.gmm` module: grouped matmul (MoE experts' GEMMs in one call) on the
tensors' own backend, differentiable in x, weight and bias.

    from mindspeed.ops import gmm
    y = gmm.npu_gmm(x, weight, group_list=[3, 8])           # cumulative row ends
    y = gmm.npu_gmm_v2(x, weight, group_list=sizes_tensor)  # per-group row counts
"""
from __future__ import annotations

from mindspeed.backends import backend_for

__all__ = ["npu_gmm", "npu_gmm_v2"]


def npu_gmm(x, weight, *, bias=None, group_list=None, group_type: int = 0, gemm_fusion: bool = False,
            original_weight=None):
    """y [M, N]: the rows of x [M, K] (sorted by group) of group g times weight[g] ([G, K, N]), plus
    bias[g] ([G, N]) when given. group_list: a list or 1-d integer tensor of cumulative row ends, one
    per group; rows past the last end come out 0. Only group_type 0 (groups along M) is supported."""
    _refuse_gemm_fusion("npu_gmm", gemm_fusion, original_weight)
    return grouped_gemm("npu_gmm", x, weight, bias, group_list, group_type, group_list_type=0)


def npu_gmm_v2(x, weight, *, bias=None, group_list=None, group_type: int = 0, gemm_fusion: bool = False,
               original_weight=None):
    """npu_gmm with group_list a 1-d integer tensor of per-group row counts (what a router's token
    counts give, without a cumsum)."""
    _refuse_gemm_fusion("npu_gmm_v2", gemm_fusion, original_weight)
    if not _is_tensor(group_list):
        raise ValueError(f"npu_gmm_v2: group_list must be a 1-d integer tensor of group sizes, got "
                         f"{type(group_list).__name__}; pass a list of cumulative ends to npu_gmm instead")
    return grouped_gemm("npu_gmm_v2", x, weight, bias, group_list, group_type, group_list_type=1)


def grouped_gemm(op: str, x, weight, bias, group_list, group_type: int, group_list_type: int):
    """The grouped matmul behind npu_gmm, npu_gmm_v2 and the flat mindspeed.ops.npu_gmm; `op` names
    the caller in errors."""
    if group_type != 0:
        raise ValueError(f"{op}: only group_type 0 (groups along M) is supported, got {group_type}")
    if group_list is None:
        raise ValueError(f"{op}: group_list is required (one entry per weight group)")
    if _is_tensor(group_list):
        if group_list.ndim != 1 or "int" not in str(group_list.dtype).lower():   # torch.int64 / MindSpore Int64
            raise ValueError(f"{op}: group_list must be a 1-d integer tensor, got shape {tuple(group_list.shape)} "
                             f"dtype {group_list.dtype}")
    elif not (isinstance(group_list, (list, tuple)) and all(isinstance(v, int) for v in group_list)):
        raise ValueError(f"{op}: group_list must be a list of ints or a 1-d integer tensor, got {group_list!r}")
    backend = backend_for(x)
    out = backend.kernels.gmm(x, weight, group_list, group_list_type)
    return out if bias is None else _add_group_bias(backend, out, bias, group_sizes(group_list, group_list_type))


def group_sizes(group_list, group_list_type: int) -> list[int]:
    """Row counts per group from cumulative ends (type 0) or sizes (type 1)."""
    values = [int(v) for v in (group_list.tolist() if _is_tensor(group_list) else group_list)]
    return values if group_list_type == 1 else [end - start for start, end in zip([0] + values[:-1], values)]


def _add_group_bias(backend, out, bias, sizes):
    if tuple(bias.shape) != (len(sizes), out.shape[-1]):
        raise ValueError(f"gmm: bias must be [G, N] = [{len(sizes)}, {out.shape[-1]}], got {tuple(bias.shape)}")
    rest = out.shape[0] - sum(sizes)
    groups = [g for g, size in enumerate(sizes) if size]      # MindSpore cannot split off empty pieces
    pieces = backend.tensors.split(out, [sizes[g] for g in groups] + ([rest] if rest else []))
    if not pieces:
        return out                                            # no rows at all
    biased = [piece + bias[g] for g, piece in zip(groups, pieces)]
    return backend.tensors.cat(biased + pieces[len(groups):])


def _refuse_gemm_fusion(op: str, gemm_fusion: bool, original_weight) -> None:
    if gemm_fusion or original_weight is not None:
        raise ValueError(f"{op}: gemm_fusion (weight gradient added into original_weight.main_grad) is not "
                         "supported; leave it False and accumulate with npu_groupmatmul_add_fp32")


def _is_tensor(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")
