"""MindSpeed's custom-op API (the names MindSpeed users call directly), each dispatching to the
active backend's kernels: npu ops on Ascend, fast CPU paths, or the reference implementation.

    from mindspeed.ops import rms_norm, swiglu, fusion_attention

Upstream MindSpeed's op modules live beside it with upstream's signatures (docs/kernels.md lists
them), e.g. `from mindspeed.ops.gmm import npu_gmm`.
"""
from __future__ import annotations

from mindspeed.backends import backend_for
# Upstream's op modules named like a flat op below, loaded before the defs: loading a submodule binds
# it to the package attribute of its name, so a first import after the defs would shadow the flat op.
import mindspeed.ops.npu_moe_token_permute  # noqa: E402,F401
import mindspeed.ops.npu_moe_token_unpermute  # noqa: E402,F401
import mindspeed.ops.npu_ring_attention_update  # noqa: E402,F401
from mindspeed.ops.gmm import grouped_gemm
from mindspeed.ops.npu_rotary_position_embedding import npu_rotary_position_embedding

__all__ = ["rms_norm", "swiglu", "npu_rotary_position_embedding", "fusion_attention", "npu_fusion_attention",
           "npu_gmm", "npu_matmul_add_fp32", "npu_moe_token_permute", "npu_moe_token_unpermute",
           "npu_ring_attention_update", "npu_dropout_add_layer_norm"]


def _kernels(tensor):
    """The kernels of `tensor`'s framework (the active backend when it is that framework's)."""
    return backend_for(tensor).kernels


def rms_norm(x, gamma, epsilon: float = 1e-6):
    """-> (y, rstd): y = cast(x * rsqrt(mean(x^2) + eps)) * gamma; rstd fp32."""
    return _kernels(x).rms_norm(x, gamma, epsilon)


def swiglu(x, dim: int = -1):
    """silu(first half of x along dim) * second half."""
    return _kernels(x).swiglu(x, dim)


def fusion_attention(query, key, value, head_num: int, input_layout: str, *, pse=None, atten_mask=None,
                     scale: float = 1.0, keep_prob: float = 1.0, pre_tokens: int = 2**31 - 1,
                     next_tokens: int = 2**31 - 1, sparse_mode: int = 0, actual_seq_qlen=None,
                     actual_seq_kvlen=None):
    """npu_fusion_attention's convention -> (out, softmax_max, softmax_sum): softmax(scale * (pse +
    Q K^T)) V with scale defaulting to 1.0 as there (pass 1/sqrt(d)); atten_mask True = masked
    out; pse e.g. alibi; sparse_mode 0 mask + band, 1 mask only, 2 causal, 3 bottom-right
    causal, 4 band. Stats fp32 [b, n, s] (TND [t, n]), logsumexp = max + log(sum)."""
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"fusion_attention: keep_prob must be in (0, 1], got {keep_prob}")
    if sparse_mode not in (0, 1, 2, 3, 4):
        raise ValueError(f"fusion_attention: sparse_mode {sparse_mode} is not supported (0-4)")
    sq = query.shape[0 if input_layout in ("SBH", "TND") else (2 if input_layout == "BNSD" else 1)]
    skv = key.shape[0 if input_layout in ("SBH", "TND") else (2 if input_layout == "BNSD" else 1)]
    band = {0: dict(pre_tokens=pre_tokens, next_tokens=next_tokens), 1: {}, 2: dict(causal=True),
            3: dict(next_tokens=skv - sq), 4: dict(pre_tokens=pre_tokens, next_tokens=next_tokens)}[sparse_mode]
    return _kernels(query).attention(query, key, value, layout=input_layout, head_num=head_num, mask=atten_mask,
                                scale=scale, dropout_p=1.0 - keep_prob, actual_seq_qlen=actual_seq_qlen,
                                actual_seq_kvlen=actual_seq_kvlen, alibi=None if pse is None else pse * scale, **band)


npu_fusion_attention = fusion_attention


def npu_gmm(x, weight, *, bias=None, group_list=None, group_type: int = 0, group_list_type: int = 0):
    """Grouped matmul: x [M, K] rows sorted by group, weight [G, K, N]; group_list cumulative
    ends (group_list_type 0) or sizes (1). Only group_type 0 (split M) is supported."""
    return grouped_gemm("npu_gmm", x, weight, bias, group_list, group_type, group_list_type)


def npu_matmul_add_fp32(total_input, grad_output, main_grad):
    """In place main_grad += grad_output^T @ total_input, in fp32."""
    return _kernels(total_input).matmul_add_fp32(total_input, grad_output, main_grad)


def npu_moe_token_permute(tokens, routing_map):
    """-> (permuted_tokens, sorted_indices); routing_map [T, E] bool, expert-major order."""
    return _kernels(tokens).moe_permute(tokens, routing_map)


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, restore_shape=None, routing_map=None):
    """Scatter-add permuted rows back to restore_shape (default [T, H] from probs or indices)."""
    if restore_shape is None:
        rows = int(sorted_indices.max()) + 1 if sorted_indices.numel() else 0
        restore_shape = (probs.shape[0] if probs is not None and probs.dim() == 2 else rows, permuted_tokens.shape[-1])
    return _kernels(permuted_tokens).moe_unpermute(permuted_tokens, sorted_indices, probs, restore_shape, routing_map=routing_map)


def npu_ring_attention_update(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max,
                              cur_softmax_sum, actual_seq_qlen=None, layout: str = "SBH"):
    """Online-softmax merge of two partial attention results -> (out, max, sum)."""
    if actual_seq_qlen is not None and layout != "TND":
        raise ValueError("npu_ring_attention_update: actual_seq_qlen is only meaningful with layout TND")
    return _kernels(prev_attn_out).ring_attention_update(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out,
                                            cur_softmax_max, cur_softmax_sum, layout=layout)


def npu_dropout_add_layer_norm(x0, residual, weight, bias, dropout_p: float, epsilon: float, rowscale=None,
                               layerscale=None, prenorm: bool = False, residual_in_fp32: bool = False,
                               return_dropout_mask: bool = False):
    """layer_norm(dropout(x0 * rowscale * layerscale) + residual) -> (out, mask) or (out, z, mask)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"npu_dropout_add_layer_norm: dropout_p must be in [0, 1), got {dropout_p}")
    return _kernels(x0).dropout_add_layer_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=rowscale,
                                             layerscale=layerscale, prenorm=prenorm,
                                             residual_in_fp32=residual_in_fp32,
                                             return_dropout_mask=return_dropout_mask)
