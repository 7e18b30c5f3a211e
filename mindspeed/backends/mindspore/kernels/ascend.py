"""Fast paths on Ascend: MindSpore's fused ops, adapted to docs/kernels.md semantics.

Not run on the CPU CI machine (these ops have no CPU kernel): capabilities.VERIFIED_DEVICES
says so, and the support matrix marks the ascend column as declared only.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import ops
from mindspore.ops.operations.nn_ops import FlashAttentionScore

from mindspeed.backends.mindspore.kernels import reference
from mindspeed.backends.mindspore.kernels.layouts import check_layout


def rms_norm(x, gamma, eps: float = 1e-6):
    y, rstd = ops.rms_norm(x, gamma, eps)
    return y, rstd.reshape(tuple(x.shape[:-1]) + (1,))


def swiglu(x, dim: int = -1):
    return ops.swiglu(x, dim)


def rope(x, cos, sin, mode: int = 0):
    rot_dim = cos.shape[-1]
    if rot_dim == x.shape[-1]:
        return ops.rotary_position_embedding(x, cos, sin, mode)
    head = ops.rotary_position_embedding(x[..., :rot_dim], cos, sin, mode)   # partial rotary
    return ops.cat((head, x[..., rot_dim:]), axis=-1)


def attention(q, k, v, *, layout="SBH", head_num, mask=None, scale=None, dropout_p=0.0,
              pre_tokens=reference.NO_LIMIT, next_tokens=reference.NO_LIMIT, causal=False,
              actual_seq_qlen=None, actual_seq_kvlen=None, alibi=None):
    d, scale = reference.check_attention_args(q, k, v, layout, head_num, dropout_p, scale)
    sq = q.shape[0] if layout in ("SBH", "TND") else (q.shape[2] if layout == "BNSD" else q.shape[1])
    skv = k.shape[0] if layout in ("SBH", "TND") else (k.shape[2] if layout == "BNSD" else k.shape[1])
    band = reference.band_mask(sq, skv, causal=causal, pre_tokens=pre_tokens, next_tokens=next_tokens)
    if mask is not None:
        band = mask.astype(ms.bool_) if band is None else ops.logical_or(band, mask.astype(ms.bool_))
    op = FlashAttentionScore(head_num=head_num, keep_prob=1.0 - dropout_p, scale_value=scale,
                             input_layout=layout, sparse_mode=0)
    kwargs = {}
    if layout == "TND":
        kwargs = dict(actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen)
    mx, sm, _, out = op(q, k, v, alibi, None, None, None if band is None else band.astype(ms.uint8), None, **kwargs)
    return out, mx[..., 0], sm[..., 0]    # Ascend repeats each stat 8 times in the last dim


def ring_attention_update(prev_out, prev_max, prev_sum, cur_out, cur_max, cur_sum, *, layout="SBH"):
    check_layout(layout)
    widen = lambda t: ops.broadcast_to(t.expand_dims(-1), tuple(t.shape) + (8,))
    out, mx, sm = ops.ring_attention_update(prev_out, widen(prev_max), widen(prev_sum), cur_out,
                                            widen(cur_max), widen(cur_sum), layout=layout)
    return out, mx[..., 0], sm[..., 0]


def gmm(x, weight, group_list, group_list_type: int = 0):
    sizes = reference.group_sizes(group_list, group_list_type, weight.shape[0], x.shape[0])
    ends = ms.Tensor([sum(sizes[:i + 1]) for i in range(len(sizes))], ms.int64)
    return ops.grouped_matmul([x], [weight], group_list=ends, split_item=3, group_type=0)[0]
