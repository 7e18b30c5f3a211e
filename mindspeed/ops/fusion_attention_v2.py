"""Upstream's `mindspeed.ops.fusion_attention_v2` module: npu_fusion_attention with upstream's
v2 signature and its seven results, on the tensors' own backend.

    from mindspeed.ops.fusion_attention_v2 import npu_fusion_attention
    out = npu_fusion_attention(q, k, v, head_num, "BNSD", scale=d ** -0.5)[0]
"""
from __future__ import annotations

from mindspeed.ops.npu_ring_attention_update import repeat_stat
# the flat op holds the npu conventions (sparse modes, pse before scale, keep_prob) this builds on
from mindspeed.ops import fusion_attention

__all__ = ["npu_fusion_attention"]

NO_LIMIT = 2147483647


def npu_fusion_attention(query, key, value, head_num: int, input_layout: str, *, pse=None, padding_mask=None,
                         atten_mask=None, scale: float = 1., keep_prob: float = 1., pre_tokens: int = NO_LIMIT,
                         next_tokens: int = NO_LIMIT, inner_precise: int = 0, prefix=None, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode: int = 0, gen_mask_parallel: bool = True,
                         sync: bool = False, pse_type: int = 1, q_start_idx=None, kv_start_idx=None):
    """-> (attention_out, softmax_max, softmax_sum, softmax_in, seed, offset, numels).

    attention_out = dropout(softmax(mask(scale * (pse + q k^T)))) v with pse_type 1, or
    softmax(mask(scale * q k^T + pse)) v with pse_type 0. atten_mask True / 1 = masked out;
    sparse_mode 0 mask + band, 1 mask only, 2 causal, 3 bottom-right causal, 4 band. softmax_max and
    softmax_sum are fp32 [b, n, s, 8] (TND [t, n, 8]) as Ascend returns them; softmax_in is None
    and seed, offset, numels 0 (Ascend's reserved output and dropout-mask bookkeeping).
    inner_precise, gen_mask_parallel and sync tune Ascend's kernel and change no result here."""
    if pse_type not in (0, 1):
        raise ValueError(f"npu_fusion_attention: pse_type {pse_type} (alibi generated inside the kernel) is not "
                         "supported; pass the bias as pse with pse_type 0 or 1")
    if padding_mask is not None or prefix is not None or q_start_idx is not None or kv_start_idx is not None:
        raise ValueError("npu_fusion_attention: padding_mask, prefix, q_start_idx and kv_start_idx are not "
                         "supported; express padding and prefixes through atten_mask")
    if pse is not None and pse_type == 0:
        if scale == 0:
            raise ValueError("npu_fusion_attention: pse_type 0 needs a non-zero scale")
        pse = pse / scale                       # scale * qk + pse == scale * (pse / scale + qk)
    out, softmax_max, softmax_sum = fusion_attention(
        query, key, value, head_num, input_layout, pse=pse, atten_mask=atten_mask, scale=scale,
        keep_prob=keep_prob, pre_tokens=pre_tokens, next_tokens=next_tokens, sparse_mode=sparse_mode,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen)
    return out, repeat_stat(softmax_max), repeat_stat(softmax_sum), None, 0, 0, 0
