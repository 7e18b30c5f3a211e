"""Upstream's `mindspeed.ops.npu_ring_attention_update` module: the online-softmax merge of two
partial attention results (ring attention), with the softmax statistics shaped as
npu_fusion_attention returns them: [b, n, s, 8] (TND: [t, n, 8]), each value repeated 8 times.

    from mindspeed.ops.npu_ring_attention_update import npu_ring_attention_update

`mindspeed.ops.npu_ring_attention_update` itself (the flat op) takes [b, n, s] statistics.
"""
from __future__ import annotations

from mindspeed.backends import backend_for

__all__ = ["npu_ring_attention_update"]

STAT_REPEATS = 8   # Ascend's attention kernels store each row statistic 8 times (one 32-byte block)


def npu_ring_attention_update(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max,
                              cur_softmax_sum, actual_seq_qlen=None, layout: str = "SBH"):
    """-> (attn_out, softmax_max, softmax_sum): m = max(pm, cm), sum = ps e^(pm-m) + cs e^(cm-m),
    out = (prev_out ps e^(pm-m) + cur_out cs e^(cm-m)) / sum. Outputs in `layout` (SBH, BSH, BSND,
    BNSD, TND), statistics fp32 [b, n, s, 8] (TND [t, n, 8]). actual_seq_qlen (cumulative sequence
    ends, TND only) is accepted for upstream's signature: the merge is per row, it needs no bounds."""
    if actual_seq_qlen is not None and layout != "TND":
        raise ValueError("npu_ring_attention_update: actual_seq_qlen is only meaningful with layout TND")
    stats = (prev_softmax_max, prev_softmax_sum, cur_softmax_max, cur_softmax_sum)
    for stat in stats:
        if stat.shape[-1] != STAT_REPEATS:
            raise ValueError(f"npu_ring_attention_update: softmax statistics must end in a dim of {STAT_REPEATS} "
                             f"([b, n, s, 8], as npu_fusion_attention returns them), got {tuple(stat.shape)}; "
                             "mindspeed.ops.npu_ring_attention_update takes [b, n, s]")
    pm, ps, cm, cs = (stat[..., 0] for stat in stats)
    out, softmax_max, softmax_sum = backend_for(prev_attn_out).kernels.ring_attention_update(
        prev_attn_out, pm, ps, cur_attn_out, cm, cs, layout=layout)
    return out, repeat_stat(softmax_max), repeat_stat(softmax_sum)


def repeat_stat(stat):
    """[..., s] -> [..., s, 8]: the 8-fold statistics layout of Ascend's attention kernels."""
    return stat[..., None].broadcast_to(tuple(stat.shape) + (STAT_REPEATS,))
