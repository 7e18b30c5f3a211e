"""MindSpore reference implementations of every kernel in docs/kernels.md.

Same semantics, argument checks and return conventions as the torch reference
(mindspeed/backends/torch/kernels/reference.py); tests compare the two on the same numpy
inputs, forward and backward. MindSpore's autograd of these ops is the reference backward.
Internals compute in fp32 and cast back to the input dtype.
"""
from __future__ import annotations

import functools

import mindspore as ms
import numpy as np
from mindspore import ops

from mindspeed.backends.mindspore.kernels.layouts import (check_layout, from_bnsd, head_dim_of, heads_of,
                                                         seq_bounds, stats_view, to_bnsd, value_head_dim)

NO_LIMIT = 2**31 - 1
_NEG_INF = float("-inf")


def _wide(t):
    return t if t.dtype in (ms.float64, ms.float32) else t.astype(ms.float32)


# MindSpore CPU: the BatchMatMul primitive is much faster than ops.matmul's broadcasting path on
# 4-d operands, so attention states its batched matmuls explicitly
_BMM = ops.BatchMatMul()
_BMM_T = ops.BatchMatMul(transpose_b=True)


# -- norms and activations ---------------------------------------------------------------------
def rms_norm(x, gamma, eps: float = 1e-6):
    """-> (y, rstd): y = cast(x * rsqrt(mean(x^2) + eps), x.dtype) * gamma; rstd fp32 [..., 1]."""
    if gamma.shape[-1] != x.shape[-1]:
        raise ValueError(f"rms_norm: gamma has {gamma.shape[-1]} channels, x has {x.shape[-1]}")
    xf = x.astype(ms.float32)
    rstd = ops.rsqrt((xf * xf).mean(-1, keep_dims=True) + eps)
    return (xf * rstd).astype(x.dtype) * gamma, rstd


def swiglu(x, dim: int = -1):
    if x.shape[dim] % 2:
        raise ValueError(f"swiglu: dim {dim} has odd size {x.shape[dim]}")
    a, b = ops.chunk(x, 2, axis=dim)
    a, b = _wide(a), _wide(b)
    return (a * ops.sigmoid(a) * b).astype(x.dtype)


def _rotate(x, mode: int):
    if mode == 0:
        x1, x2 = ops.chunk(x, 2, axis=-1)
        return ops.cat((-x2, x1), axis=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return ops.stack((-x2, x1), axis=-1).reshape(x.shape)


def rope(x, cos, sin, mode: int = 0):
    if mode not in (0, 1):
        raise ValueError(f"rope: mode must be 0 (rotate-half) or 1 (interleaved), got {mode}")
    rot_dim = cos.shape[-1]
    if rot_dim % 2 or rot_dim > x.shape[-1] or sin.shape[-1] != rot_dim:
        raise ValueError(f"rope: rotary dim {rot_dim} must be even, equal for cos/sin and "
                         f"at most x's last dim {x.shape[-1]}")
    # a slice of the whole last dim is still a StridedSlice copy on CPU (about a tenth of a traced
    # training step at the default example's size): only slice a partial rotary dim
    whole = rot_dim == x.shape[-1]
    xf = _wide(x if whole else x[..., :rot_dim])
    out = (xf * _wide(cos) + _rotate(xf, mode) * _wide(sin)).astype(x.dtype)
    if whole:
        return out
    return ops.cat((out, x[..., rot_dim:]), axis=-1)


# -- attention ----------------------------------------------------------------------------------
def band_mask(sq: int, skv: int, *, causal: bool, pre_tokens: int, next_tokens: int):
    """Bool [sq, skv], True = masked out; None when nothing is masked."""
    if not causal and pre_tokens >= skv and next_tokens >= skv:
        return None
    return _band_mask_cached(sq, skv, causal, pre_tokens, next_tokens)


@functools.lru_cache(maxsize=64)
def _band_mask_numpy(sq, skv, causal, pre_tokens, next_tokens):
    # built once per shape in numpy: every layer of every step asks for the same mask
    i = np.arange(sq).reshape(sq, 1)
    j = np.arange(skv).reshape(1, skv)
    nxt = min(next_tokens, 0) if causal else next_tokens
    return (j > i + nxt) | (j < i - pre_tokens)


@functools.lru_cache(maxsize=64)
def _band_mask_cached(sq, skv, causal, pre_tokens, next_tokens):
    return ms.Tensor(_band_mask_numpy(sq, skv, causal, pre_tokens, next_tokens))


def _every_row_sees_a_key(sq, skv, causal, pre_tokens, next_tokens) -> bool:
    return not _band_mask_numpy(sq, skv, causal, pre_tokens, next_tokens).all(axis=-1).any()


def _attention_bnsd(q, k, v, *, scale, mask, causal, pre_tokens, next_tokens, dropout_p, alibi, drop_mask=None):
    b, n, sq, _ = q.shape
    nkv, skv = k.shape[1], k.shape[2]
    if n % nkv:
        raise ValueError(f"attention: {n} query heads are not a multiple of {nkv} key/value heads")
    if n != nkv:
        k = ops.repeat_interleave(k, n // nkv, axis=1)
        v = ops.repeat_interleave(v, n // nkv, axis=1)
    scores = _BMM_T(_wide(q), _wide(k)) * scale
    if alibi is not None:
        scores = scores + _wide(alibi)
    masked = band_mask(sq, skv, causal=causal, pre_tokens=pre_tokens, next_tokens=next_tokens)
    if mask is not None:
        user = mask.astype(ms.bool_)
        masked = user if masked is None else ops.logical_or(masked, user)
    if masked is not None:    # additive 0 / -inf: same result as masked_fill, far cheaper on CPU
        scores = scores + ops.where(masked, ms.Tensor(_NEG_INF, scores.dtype), ms.Tensor(0.0, scores.dtype))
    row_max = ops.stop_gradient(scores.max(axis=-1, keepdims=True))   # shift-invariant
    shift = ops.where(ops.isinf(row_max), ops.zeros_like(row_max), row_max)
    p = ops.exp(scores - shift)
    row_sum = p.sum(-1, keepdims=True)
    if mask is None and _every_row_sees_a_key(sq, skv, causal, pre_tokens, next_tokens):
        # MindSpore's softmax kernel and its gradient: on CPU faster than exp / sum / divide
        # with their backward (docs/performance.md). The
        # statistics above are then used only by callers that merge partial results (ring
        # attention); a traced graph that ignores them drops them. A row with every key masked
        # (a user mask, a band or ring block) keeps the divide: it must come out 0, not NaN.
        probs = ops.softmax(scores, -1)
    else:
        probs = p / ops.where(row_sum == 0, ops.ones_like(row_sum), row_sum)
    if drop_mask is not None:
        probs = probs * drop_mask
    elif dropout_p > 0:
        probs = ops.dropout(probs, p=dropout_p)
    out = _BMM(probs, _wide(v)).astype(q.dtype)
    return out, row_max.squeeze(-1), row_sum.squeeze(-1)


def check_attention_args(q, k, v, layout, head_num, dropout_p, scale):
    check_layout(layout)
    d = head_dim_of(q, layout, head_num)
    # v's head size may differ from q's and k's (multi-latent attention); every other dim is k's
    if tuple(k.shape[:-1]) != tuple(v.shape[:-1]) or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} do not match q "
                         f"{tuple(q.shape)} in layout {layout}")
    if layout not in ("SBH", "BSH") and k.shape[-1] != d:
        raise ValueError(f"attention: key head dim {k.shape[-1]} differs from query head dim {d}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention: dropout_p must be in [0, 1), got {dropout_p}")
    nkv = heads_of(k, layout, d)
    if head_num % nkv:
        raise ValueError(f"attention: {head_num} query heads are not a multiple of {nkv} kv heads")
    value_head_dim(k, v, layout, d)       # raises where v's hidden size is no whole number of kv heads
    return d, (scale if scale is not None else d ** -0.5)


def attention(q, k, v, *, layout: str = "SBH", head_num: int, mask=None, scale=None, dropout_p: float = 0.0,
              pre_tokens: int = NO_LIMIT, next_tokens: int = NO_LIMIT, causal: bool = False,
              actual_seq_qlen=None, actual_seq_kvlen=None, alibi=None, drop_mask=None):
    """-> (out in `layout`, softmax_max, softmax_sum), fp32 stats [b, n, sq] (TND: [t, n]).
    drop_mask [b, n, sq, skv]: the caller's own dropout of the probabilities (keep / (1 - p)), in
    place of dropout_p's random one (the MindSpore trainer draws it: dropout.py)."""
    d, scale = check_attention_args(q, k, v, layout, head_num, dropout_p, scale)
    common = dict(scale=scale, causal=causal, pre_tokens=pre_tokens, next_tokens=next_tokens,
                  dropout_p=dropout_p)
    if drop_mask is not None:
        if layout == "TND":
            raise ValueError("attention: drop_mask takes the BNSD-shaped probabilities (not layout TND)")
        common["drop_mask"] = drop_mask
    if layout == "TND":
        return _attention_tnd(q, k, v, mask=mask, alibi=alibi, actual_seq_qlen=actual_seq_qlen,
                              actual_seq_kvlen=actual_seq_kvlen, **common)
    out, mx, sm = _attention_bnsd(to_bnsd(q, layout, d), to_bnsd(k, layout, d),
                                  to_bnsd(v, layout, value_head_dim(k, v, layout, d)),
                                  mask=mask, alibi=alibi, **common)
    return from_bnsd(out, layout), mx, sm


def _attention_tnd(q, k, v, *, mask, alibi, actual_seq_qlen, actual_seq_kvlen, **common):
    q_bounds = seq_bounds(actual_seq_qlen, q.shape[0], "actual_seq_qlen")
    kv_bounds = seq_bounds(actual_seq_kvlen, k.shape[0], "actual_seq_kvlen")
    if len(q_bounds) != len(kv_bounds):
        raise ValueError("attention TND: actual_seq_qlen and actual_seq_kvlen name different sequence counts")
    outs, maxes, sums = [], [], []
    for (qs, qe), (ks, ke) in zip(q_bounds, kv_bounds):
        as_bnsd = lambda t, s, e: t[s:e].swapaxes(0, 1).expand_dims(0)   # [1, n, s_i, d]
        m = None if mask is None else mask[..., :qe - qs, :ke - ks]
        a = None if alibi is None else alibi[..., :qe - qs, :ke - ks]
        o, mx, sm = _attention_bnsd(as_bnsd(q, qs, qe), as_bnsd(k, ks, ke), as_bnsd(v, ks, ke),
                                    mask=m, alibi=a, **common)
        outs.append(o[0].swapaxes(0, 1))
        maxes.append(mx[0].swapaxes(0, 1))
        sums.append(sm[0].swapaxes(0, 1))
    return ops.cat(outs), ops.cat(maxes), ops.cat(sums)


def ring_attention_update(prev_out, prev_max, prev_sum, cur_out, cur_max, cur_sum, *, layout: str = "SBH"):
    check_layout(layout)
    if prev_out.shape != cur_out.shape or prev_max.shape != cur_max.shape:
        raise ValueError(f"ring_attention_update: shapes differ: out {tuple(prev_out.shape)} vs "
                         f"{tuple(cur_out.shape)}, stats {tuple(prev_max.shape)} vs {tuple(cur_max.shape)}")
    m = ops.maximum(prev_max, cur_max)
    m_safe = ops.where(ops.isinf(m), ops.zeros_like(m), m)
    w_prev = prev_sum * ops.exp(prev_max - m_safe)
    w_cur = cur_sum * ops.exp(cur_max - m_safe)
    total = w_prev + w_cur
    denom = ops.where(total == 0, ops.ones_like(total), total)
    a_prev = stats_view(w_prev / denom, layout, prev_out)
    a_cur = stats_view(w_cur / denom, layout, cur_out)
    out = (_wide(prev_out) * a_prev + _wide(cur_out) * a_cur).astype(prev_out.dtype)
    return out, m, total


# -- matmuls ------------------------------------------------------------------------------------
def group_sizes(group_list, group_list_type: int, num_groups: int, rows: int) -> list:
    if group_list_type not in (0, 1):
        raise ValueError(f"gmm: group_list_type must be 0 (cumulative ends) or 1 (sizes), got {group_list_type}")
    raw = group_list.asnumpy().tolist() if hasattr(group_list, "asnumpy") else group_list
    values = [int(g) for g in raw]
    if len(values) != num_groups:
        raise ValueError(f"gmm: group_list has {len(values)} entries for {num_groups} weight groups")
    sizes = values if group_list_type == 1 else [e - s for s, e in zip([0] + values[:-1], values)]
    if any(s < 0 for s in sizes) or sum(sizes) > rows:
        raise ValueError(f"gmm: group_list {values} (type {group_list_type}) is not a valid split of {rows} rows")
    return sizes


def gmm(x, weight, group_list, group_list_type: int = 0):
    """x [M, K] rows sorted by group, weight [G, K, N]: group g's rows times weight[g]; rows past
    the last group are zero."""
    if x.ndim != 2 or weight.ndim != 3 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gmm: expected x [M, K] and weight [G, K, N], got {tuple(x.shape)} and {tuple(weight.shape)}")
    sizes = group_sizes(group_list, group_list_type, weight.shape[0], x.shape[0])
    parts, start = [], 0
    for g, size in enumerate(sizes):
        if size:   # MindSpore CPU kernels reject empty operands: empty groups add no rows anyway
            parts.append(ops.matmul(x[start:start + size], weight[g]))
        start += size
    if start < x.shape[0]:
        parts.append(ops.zeros((x.shape[0] - start, weight.shape[2]), x.dtype))
    return ops.cat(parts, axis=0)


def matmul_add_fp32(x, dy, main_grad):
    """In place main_grad += dy^T @ x in fp32; returns main_grad."""
    if main_grad.dtype != ms.float32:
        raise ValueError(f"matmul_add_fp32: main_grad must be float32, got {main_grad.dtype}")
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    if tuple(main_grad.shape) != (dy2.shape[1], x2.shape[1]) or x2.shape[0] != dy2.shape[0]:
        raise ValueError(f"matmul_add_fp32: main_grad {tuple(main_grad.shape)} != dy^T @ x shape "
                         f"({dy2.shape[1]}, {x2.shape[1]}) or row counts differ")
    main_grad.assign_value(main_grad + ops.matmul(dy2.astype(ms.float32).T, x2.astype(ms.float32)))
    return main_grad


def grouped_matmul_add_fp32(x, dy, group_list, main_grad, group_list_type: int = 0):
    """In place main_grad (read as [G, K, N]) [g] += x_g^T @ dy_g in fp32; returns main_grad."""
    if main_grad.dtype != ms.float32:
        raise ValueError(f"grouped_matmul_add_fp32: main_grad must be float32, got {main_grad.dtype}")
    if x.ndim != 2 or dy.ndim != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(f"grouped_matmul_add_fp32: expected x [M, K] and dy [M, N], got {tuple(x.shape)} "
                         f"and {tuple(dy.shape)}")
    num_groups, k, n = len(group_list), x.shape[1], dy.shape[1]
    if main_grad.size != num_groups * k * n:
        raise ValueError(f"grouped_matmul_add_fp32: main_grad {tuple(main_grad.shape)} does not hold "
                         f"[{num_groups}, {k}, {n}] (groups, K, N)")
    sizes = group_sizes(group_list, group_list_type, num_groups, x.shape[0])
    parts, start = [], 0
    for size in sizes:
        if size:   # MindSpore CPU kernels reject empty operands: an empty group adds zeros
            parts.append(ops.matmul(x[start:start + size].astype(ms.float32).T, dy[start:start + size].astype(ms.float32)))
        else:
            parts.append(ops.zeros((k, n), ms.float32))
        start += size
    # MindSpore slices are copies: one assign of the whole buffer keeps the update in place
    main_grad.assign_value(main_grad + ops.stack(parts).reshape(main_grad.shape))
    return main_grad


# -- MoE token permutation ------------------------------------------------------------------------
def moe_permute(tokens, routing_map):
    """-> (permuted [P, H] expert-major, token order within an expert; sorted_indices [P])."""
    if routing_map.ndim != 2 or tokens.shape[0] != routing_map.shape[0]:
        raise ValueError(f"moe_permute: routing_map {tuple(routing_map.shape)} must be [T, E] with "
                         f"T = tokens rows {tokens.shape[0]}")
    num_tokens, num_experts = routing_map.shape
    token_ids = ops.broadcast_to(ops.arange(num_tokens, dtype=ms.int32).reshape(1, -1), (num_experts, num_tokens))
    sorted_indices = ops.masked_select(token_ids, routing_map.astype(ms.bool_).T)
    return ops.gather(tokens, sorted_indices, 0), sorted_indices


def moe_unpermute(permuted_tokens, sorted_indices, probs, restore_shape, *, routing_map=None):
    """Scatter-add rows back to restore_shape [T, H], each weighted by its prob."""
    if probs is not None and probs.ndim == 2:
        if routing_map is None:
            raise ValueError("moe_unpermute: [T, E] probs need the routing_map that made the permutation")
        probs = ops.masked_select(probs.T, routing_map.astype(ms.bool_).T)
    rows = permuted_tokens
    if probs is not None:
        if probs.shape[0] != permuted_tokens.shape[0]:
            raise ValueError(f"moe_unpermute: {probs.shape[0]} probs for {permuted_tokens.shape[0]} rows")
        rows = (permuted_tokens.astype(ms.float32) * probs.astype(ms.float32).expand_dims(-1)
                ).astype(permuted_tokens.dtype)
    return ops.unsorted_segment_sum(rows, sorted_indices.astype(ms.int32), int(restore_shape[0]))


# -- dropout + add + layer norm -------------------------------------------------------------------
def _layer_norm(z, weight, bias, eps):
    mean = z.mean(-1, keep_dims=True)
    var = ((z - mean) ** 2).mean(-1, keep_dims=True)
    y = (z - mean) * ops.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.astype(ms.float32)
    if bias is not None:
        y = y + bias.astype(ms.float32)
    return y


def dropout_add_layer_norm(x0, residual, weight, bias, dropout_p: float, epsilon: float, *, rowscale=None,
                           layerscale=None, prenorm: bool = False, residual_in_fp32: bool = False,
                           return_dropout_mask: bool = False):
    """z = dropout(x0 * rowscale * layerscale) + residual; out = layer_norm(z). Returns (out, mask)
    or, with prenorm, (out, z, mask)."""
    x = x0
    if rowscale is not None:
        x = x * rowscale.expand_dims(-1)
    if layerscale is not None:
        x = x * layerscale
    keep = None
    if dropout_p > 0:
        keep = ops.rand(x.shape, dtype=ms.float32) >= dropout_p
        x = x * keep.astype(x.dtype) / (1.0 - dropout_p)
    z = x.astype(ms.float32) + residual.astype(ms.float32) if residual is not None else x.astype(ms.float32)
    out = _layer_norm(z, weight, bias, epsilon).astype(x0.dtype)
    z = z if residual_in_fp32 else z.astype(x0.dtype)
    mask = keep if return_dropout_mask else None
    return (out, z, mask) if prenorm else (out, mask)
