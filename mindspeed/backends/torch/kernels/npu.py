"""torch_npu fast paths (Ascend). Imported only when the torch backend runs on npu, i.e. after
torch_npu imported successfully. Each function maps the docs/kernels.md contract onto the torch_npu
op of the same row in docs/kernels.md; it cannot run without an NPU, so it stays a thin mapping.
"""
from __future__ import annotations

import torch
import torch_npu  # noqa: F401  (only importable on Ascend machines)

from mindspeed.backends.torch.kernels import reference
from mindspeed.backends.torch.kernels.layouts import check_layout, resize_heads, value_head_dim

_CAUSAL_MASK_SIZE = 2048   # npu_fusion_attention's compressed mask for sparse modes 2/3/4


def rms_norm(x, gamma, eps: float = 1e-6):
    return torch_npu.npu_rms_norm(x, gamma, epsilon=eps)


def swiglu(x, dim: int = -1):
    return torch_npu.npu_swiglu(x, dim=dim)


def rope(x, cos, sin, mode: int = 0):
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return torch_npu.npu_rotary_position_embedding(x, cos.to(x.dtype), sin.to(x.dtype), mode)
    rotated = torch_npu.npu_rotary_position_embedding(x[..., :rot].contiguous(), cos.to(x.dtype),
                                                     sin.to(x.dtype), mode)
    return torch.cat((rotated, x[..., rot:]), -1)


def _compressed_causal(device):
    return torch.ones(_CAUSAL_MASK_SIZE, _CAUSAL_MASK_SIZE, dtype=torch.bool, device=device).triu(1)


def attention(q, k, v, *, layout: str = "SBH", head_num: int, mask=None, scale=None, dropout_p: float = 0.0,
              pre_tokens: int = reference.NO_LIMIT, next_tokens: int = reference.NO_LIMIT, causal: bool = False,
              actual_seq_qlen=None, actual_seq_kvlen=None, alibi=None):
    d, scale = reference.check_attention_args(q, k, v, layout, head_num, dropout_p, scale)
    dv = value_head_dim(k, v, layout, d)
    if dv != d:
        # an unequal v (multi-latent attention): one head size for q, k and v, which every CANN version's
        # npu_fusion_attention takes; zero channels leave the scores and v's own output channels exact
        width = max(d, dv)
        out, softmax_max, softmax_sum = attention(
            resize_heads(q, layout, d, width), resize_heads(k, layout, d, width), resize_heads(v, layout, dv, width),
            layout=layout, head_num=head_num, mask=mask, scale=scale, dropout_p=dropout_p, pre_tokens=pre_tokens,
            next_tokens=next_tokens, causal=causal, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
            alibi=alibi)
        return resize_heads(out, layout, width, dv), softmax_max, softmax_sum
    if mask is None and causal and pre_tokens >= reference.NO_LIMIT:
        sparse_mode, atten_mask = 2, _compressed_causal(q.device)           # leftUpCausal
    elif mask is None and (pre_tokens < reference.NO_LIMIT or next_tokens < reference.NO_LIMIT):
        sparse_mode, atten_mask = 4, _compressed_causal(q.device)           # band
        next_tokens = min(next_tokens, 0) if causal else next_tokens
    else:                                                                   # explicit mask (+ causal/band)
        sq = q.shape[0 if layout in ("SBH", "TND") else (2 if layout == "BNSD" else 1)]
        skv = k.shape[0 if layout in ("SBH", "TND") else (2 if layout == "BNSD" else 1)]
        band = reference.band_mask(sq, skv, causal=causal, pre_tokens=pre_tokens, next_tokens=next_tokens,
                                   device=q.device)
        atten_mask = mask.bool() if band is None else (band if mask is None else band | mask.bool())
        sparse_mode, pre_tokens, next_tokens = 0, reference.NO_LIMIT, reference.NO_LIMIT
    out, softmax_max, softmax_sum, *_ = torch_npu.npu_fusion_attention(
        q, k, v, head_num, check_layout(layout), pse=None if alibi is None else alibi / scale,   # npu: scale*(pse+QK)
        atten_mask=atten_mask, scale=scale, keep_prob=1.0 - dropout_p, pre_tockens=pre_tokens,
        next_tockens=next_tokens, sparse_mode=sparse_mode,
        actual_seq_qlen=None if actual_seq_qlen is None else list(map(int, actual_seq_qlen)),
        actual_seq_kvlen=None if actual_seq_kvlen is None else list(map(int, actual_seq_kvlen)))
    return out, softmax_max[..., 0], softmax_sum[..., 0]       # npu repeats the stats 8x on the last dim


def ring_attention_update(prev_out, prev_max, prev_sum, cur_out, cur_max, cur_sum, *, layout: str = "SBH"):
    rep = lambda t: t.unsqueeze(-1).expand(*t.shape, 8).contiguous()   # npu wants [.., 8] stats
    out, mx, sm = torch_npu.npu_ring_attention_update(prev_out, rep(prev_max), rep(prev_sum), cur_out,
                                                       rep(cur_max), rep(cur_sum), layout=layout)
    return out, mx[..., 0], sm[..., 0]


def gmm(x, weight, group_list, group_list_type: int = 0):
    groups = torch.as_tensor(group_list, dtype=torch.int64, device=x.device)
    return torch_npu.npu_grouped_matmul([x], [weight], group_list=groups, split_item=2, group_type=0,
                                        group_list_type=group_list_type)[0]


def matmul_add_fp32(x, dy, main_grad):
    # MindSpeed's npu_matmul_add_fp32 is its own op plugin; the in-place addmm is its exact semantics
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    return main_grad.addmm_(dy2.t().float(), x2.float())


def moe_permute(tokens, routing_map):
    permuted, _probs, sorted_indices = torch_npu.npu_moe_token_permute_with_routing_map(
        tokens, routing_map.to(torch.int8), num_out_tokens=int(routing_map.sum()))
    return permuted, sorted_indices


def moe_unpermute(permuted_tokens, sorted_indices, probs, restore_shape, *, routing_map=None):
    return torch_npu.npu_moe_token_unpermute_with_routing_map(
        permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map)


def dropout_add_layer_norm(*args, **kwargs):
    return reference.dropout_add_layer_norm(*args, **kwargs)   # no single torch_npu op: composed ops
