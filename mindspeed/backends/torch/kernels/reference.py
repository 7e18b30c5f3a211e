"""Reference implementations of every kernel in docs/kernels.md: plain torch ops, obviously correct.

Their autograd is the reference backward. Fast paths (cpu.py, npu.py) are tested against these.
Internals compute in fp32 and cast results back to the input dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mindspeed.backends.torch.kernels.layouts import (check_layout, from_bnsd, head_dim_of, heads_of,
                                                     seq_bounds, stats_view, to_bnsd, value_head_dim)

NO_LIMIT = 2**31 - 1   # pre_tokens / next_tokens default: no band


def _wide(t):
    """fp32 for low-precision inputs; fp64 stays fp64 (tests use it as ground truth)."""
    return t if t.dtype == torch.float64 else t.float()


# -- norms and activations ---------------------------------------------------------------------
def rms_norm(x, gamma, eps: float = 1e-6):
    """y = cast(x * rsqrt(mean(x^2) + eps), x.dtype) * gamma (Megatron/HF rounding: before gamma).
    Returns (y, rstd) with rstd fp32 shaped x.shape[:-1] + (1,)."""
    if gamma.shape[-1] != x.shape[-1]:
        raise ValueError(f"rms_norm: gamma has {gamma.shape[-1]} channels, x has {x.shape[-1]}")
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype) * gamma, rstd


def swiglu(x, dim: int = -1):
    """silu(a) * b where a, b = x.chunk(2, dim) (a is the first half)."""
    if x.shape[dim] % 2:
        raise ValueError(f"swiglu: dim {dim} has odd size {x.shape[dim]}")
    a, b = x.chunk(2, dim)
    return (F.silu(_wide(a)) * _wide(b)).to(x.dtype)


def _rotate(x, mode: int):
    if mode == 0:                                   # rotate-half: cat(-x2, x1)
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)
    x1, x2 = x[..., 0::2], x[..., 1::2]             # interleaved pairs (x0,x1),(x2,x3)...
    return torch.stack((-x2, x1), -1).flatten(-2)


def rope(x, cos, sin, mode: int = 0):
    """x*cos + rotate(x)*sin on the first cos.shape[-1] channels; the rest pass through.
    mode 0 rotate-half, mode 1 interleaved; cos/sin broadcast against x."""
    if mode not in (0, 1):
        raise ValueError(f"rope: mode must be 0 (rotate-half) or 1 (interleaved), got {mode}")
    rot_dim = cos.shape[-1]
    if rot_dim % 2 or rot_dim > x.shape[-1] or sin.shape[-1] != rot_dim:
        raise ValueError(f"rope: rotary dim {rot_dim} must be even, equal for cos/sin and "
                         f"at most x's last dim {x.shape[-1]}")
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    xf = _wide(x_rot)
    out = (xf * _wide(cos) + _rotate(xf, mode) * _wide(sin)).to(x.dtype)
    return torch.cat((out, x_pass), -1) if x_pass.shape[-1] else out


# -- attention ----------------------------------------------------------------------------------
def band_mask(sq: int, skv: int, *, causal: bool, pre_tokens: int, next_tokens: int, device=None):
    """Bool [sq, skv], True = masked out: causal (top-left) keeps j <= i; band keeps
    i - pre_tokens <= j <= i + next_tokens. None when nothing is masked."""
    if not causal and pre_tokens >= skv and next_tokens >= skv:
        return None
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(skv, device=device).unsqueeze(0)
    nxt = min(next_tokens, 0) if causal else next_tokens
    return (j > i + nxt) | (j < i - pre_tokens)


def repeat_kv(k, v, groups: int):
    """GQA for kernels that want equal head counts: each key/value head serves `groups` query heads."""
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)


def sum_kv_groups(dk, dv, groups: int):
    """The transpose of repeat_kv: a key/value head's gradient is the sum over its query heads."""
    if groups == 1:
        return dk, dv
    b, n, s, d = dk.shape
    return dk.view(b, n // groups, groups, s, d).sum(2), dv.view(b, n // groups, groups, s, d).sum(2)


def _attention_bnsd(q, k, v, *, scale, mask, causal, pre_tokens, next_tokens, dropout_p, alibi):
    b, n, sq, _ = q.shape
    nkv, skv = k.shape[1], k.shape[2]
    if n % nkv:
        raise ValueError(f"attention: {n} query heads are not a multiple of {nkv} key/value heads")
    k, v = repeat_kv(k, v, n // nkv)                # GQA: query head h reads kv head h // (n // nkv)
    scores = torch.matmul(_wide(q), _wide(k).transpose(-1, -2)) * scale
    if alibi is not None:
        scores = scores + _wide(alibi)
    masked = band_mask(sq, skv, causal=causal, pre_tokens=pre_tokens, next_tokens=next_tokens,
                       device=q.device)
    if mask is not None:
        masked = mask.bool() if masked is None else (masked | mask.bool())
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).detach()   # softmax is shift-invariant: no gradient
    shift = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(scores - shift)
    row_sum = p.sum(-1, keepdim=True)
    probs = p / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)   # fully masked -> 0
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    out = torch.matmul(probs, _wide(v)).to(q.dtype)
    return out, row_max.squeeze(-1), row_sum.squeeze(-1)


def check_attention_args(q, k, v, layout, head_num, dropout_p, scale):
    check_layout(layout)
    d = head_dim_of(q, layout, head_num)
    # v's head size may differ from q's and k's (multi-latent attention); every other dim is k's
    if k.shape[:-1] != v.shape[:-1] or k.dim() != q.dim() or v.dim() != q.dim():
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
              actual_seq_qlen=None, actual_seq_kvlen=None, alibi=None):
    """softmax(scale*QK^T + alibi, masked) V. mask: bool, True = masked out, broadcastable to
    [b, n, sq, skv] (TND: [sq_i, skv_i] slices of a shared mask). Returns (out in `layout`,
    softmax_max, softmax_sum) with fp32 stats [b, n, sq] (TND: [t, n]); logsumexp = max + log(sum).
    Fully masked rows give out 0, max -inf, sum 0. v's head size may differ from q's and k's (the
    output's is v's; multi-latent attention)."""
    d, scale = check_attention_args(q, k, v, layout, head_num, dropout_p, scale)
    return attend_in_layout(_attention_bnsd, q, k, v, layout, d, mask=mask, alibi=alibi,
                            actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, scale=scale,
                            causal=causal, pre_tokens=pre_tokens, next_tokens=next_tokens, dropout_p=dropout_p)


def attend_in_layout(core, q, k, v, layout: str, head_dim: int, *, mask, alibi, actual_seq_qlen, actual_seq_kvlen,
                     **common):
    """Run an attention core on [b, n, s, d] views (core(q, k, v, mask=, alibi=, **common) -> out,
    max, sum) for tensors in `layout`; TND runs it once per packed sequence, with that sequence's
    corner of the mask and alibi. Every backend's kernel (reference, cpu, cuda) shares this."""
    if layout != "TND":
        out, mx, sm = core(to_bnsd(q, layout, head_dim), to_bnsd(k, layout, head_dim),
                           to_bnsd(v, layout, value_head_dim(k, v, layout, head_dim)), mask=mask, alibi=alibi, **common)
        return from_bnsd(out, layout), mx, sm
    q_bounds = seq_bounds(actual_seq_qlen, q.shape[0], "actual_seq_qlen")
    kv_bounds = seq_bounds(actual_seq_kvlen, k.shape[0], "actual_seq_kvlen")
    if len(q_bounds) != len(kv_bounds):
        raise ValueError("attention TND: actual_seq_qlen and actual_seq_kvlen name different sequence counts")
    outs, maxes, sums = [], [], []
    for (qs, qe), (ks, ke) in zip(q_bounds, kv_bounds):
        as_bnsd = lambda t, s, e: t[s:e].transpose(0, 1).unsqueeze(0)   # [1, n, s_i, d]
        m = None if mask is None else mask[..., :qe - qs, :ke - ks]
        a = None if alibi is None else alibi[..., :qe - qs, :ke - ks]
        o, mx, sm = core(as_bnsd(q, qs, qe), as_bnsd(k, ks, ke), as_bnsd(v, ks, ke), mask=m, alibi=a, **common)
        outs.append(o[0].transpose(0, 1))
        maxes.append(mx[0].transpose(0, 1))
        sums.append(sm[0].transpose(0, 1))
    return torch.cat(outs), torch.cat(maxes), torch.cat(sums)


def fast_path_bias(q, k, *, mask, causal, pre_tokens, next_tokens, alibi, unmask_empty_rows: bool = False):
    """What a fused kernel takes for the reference's masking: (plain_causal, bias, empty_rows).
    plain_causal: causal self-attention with nothing else (the kernel's own causal flag, no bias).
    Else bias: the additive float mask (alibi, -inf where masked; None when nothing is), at least 2-d,
    and empty_rows the bool [..., sq] of query rows whose every key is masked (None when none can be).
    unmask_empty_rows: those rows get no -inf (for kernels that give NaN there; zero their output)."""
    sq, skv = q.shape[2], k.shape[2]
    if causal and mask is None and alibi is None and pre_tokens >= sq and next_tokens >= 0:
        return True, None, None      # (a causal band_mask is never None: no need to build it)
    masked = band_mask(sq, skv, causal=causal, pre_tokens=pre_tokens, next_tokens=next_tokens, device=q.device)
    if mask is not None:
        masked = mask.bool() if masked is None else (masked | mask.bool())
    if masked is None and alibi is None:
        return False, None, None
    bias = torch.zeros((), dtype=q.dtype, device=q.device)
    if alibi is not None:
        bias = bias + alibi.to(q.dtype)
    empty_rows = None
    if masked is not None:
        empty_rows = masked.all(-1)
        hide = masked & ~empty_rows.unsqueeze(-1) if unmask_empty_rows else masked
        bias = torch.where(hide, float("-inf"), bias)
    while bias.dim() < 2:
        bias = bias.unsqueeze(0)
    return False, bias, empty_rows


def stats_from_logsumexp(lse, empty_rows):
    """A fused kernel's logsumexp as the reference's (max, sum): (lse, 1), since logsumexp = max +
    log(sum); rows with every key masked get the reference's max -inf and sum 0."""
    row_max, row_sum = lse, torch.ones_like(lse)
    if empty_rows is not None and bool(empty_rows.any()):
        empty = empty_rows.expand(lse.shape)
        row_max = row_max.masked_fill(empty, float("-inf"))
        row_sum = row_sum.masked_fill(empty, 0.0)
    return row_max, row_sum


def fast_attention(core, device_type: str, q, k, v, *, layout: str = "SBH", head_num: int, mask=None, scale=None,
                   dropout_p: float = 0.0, pre_tokens: int = NO_LIMIT, next_tokens: int = NO_LIMIT,
                   causal: bool = False, actual_seq_qlen=None, actual_seq_kvlen=None, alibi=None):
    """A device's attention kernel: `core` on [b, n, s, d] views for fp32/bf16/fp16 tensors on
    `device_type` without dropout; the reference for everything else."""
    d, scale = check_attention_args(q, k, v, layout, head_num, dropout_p, scale)
    if dropout_p > 0 or q.device.type != device_type or q.dtype not in (torch.float32, torch.bfloat16,
                                                                         torch.float16):
        return attention(q, k, v, layout=layout, head_num=head_num, mask=mask, scale=scale, dropout_p=dropout_p,
                         pre_tokens=pre_tokens, next_tokens=next_tokens, causal=causal,
                         actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, alibi=alibi)
    return attend_in_layout(core, q, k, v, layout, d, mask=mask, alibi=alibi, actual_seq_qlen=actual_seq_qlen,
                            actual_seq_kvlen=actual_seq_kvlen, scale=scale, causal=causal, pre_tokens=pre_tokens,
                            next_tokens=next_tokens)


def ring_attention_update(prev_out, prev_max, prev_sum, cur_out, cur_max, cur_sum, *, layout: str = "SBH"):
    """Online-softmax merge of two partial attention results over disjoint key blocks.
    m = max(pm, cm); l = ps*e^(pm-m) + cs*e^(cm-m); out = (prev*ps*e^(pm-m) + cur*cs*e^(cm-m)) / l.
    Stats fp32 [b, n, s] (TND: [t, n]); outs in `layout`. Returns (out, max, sum)."""
    check_layout(layout)
    if prev_out.shape != cur_out.shape or prev_max.shape != cur_max.shape:
        raise ValueError(f"ring_attention_update: shapes differ: out {tuple(prev_out.shape)} vs "
                         f"{tuple(cur_out.shape)}, stats {tuple(prev_max.shape)} vs {tuple(cur_max.shape)}")
    m = torch.maximum(prev_max, cur_max)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)   # both blocks fully masked
    w_prev = prev_sum * torch.exp(prev_max - m_safe)
    w_cur = cur_sum * torch.exp(cur_max - m_safe)
    total = w_prev + w_cur
    denom = torch.where(total == 0, torch.ones_like(total), total)
    a_prev = stats_view(w_prev / denom, layout, prev_out)
    a_cur = stats_view(w_cur / denom, layout, cur_out)
    out = (_wide(prev_out) * a_prev + _wide(cur_out) * a_cur).to(prev_out.dtype)
    return out, m, total


# -- matmuls ------------------------------------------------------------------------------------
def group_sizes(group_list, group_list_type: int, num_groups: int, rows: int) -> list[int]:
    """Per-group row counts from cumulative ends (type 0) or sizes (type 1), validated."""
    if group_list_type not in (0, 1):
        raise ValueError(f"gmm: group_list_type must be 0 (cumulative ends) or 1 (sizes), got {group_list_type}")
    values = [int(g) for g in (group_list.tolist() if torch.is_tensor(group_list) else group_list)]
    if len(values) != num_groups:
        raise ValueError(f"gmm: group_list has {len(values)} entries for {num_groups} weight groups")
    sizes = values if group_list_type == 1 else [e - s for s, e in zip([0] + values[:-1], values)]
    if any(s < 0 for s in sizes) or sum(sizes) > rows:
        raise ValueError(f"gmm: group_list {values} (type {group_list_type}) is not a valid split of {rows} rows")
    return sizes


def gmm(x, weight, group_list, group_list_type: int = 0):
    """x [M, K] rows sorted by group, weight [G, K, N]: out rows of group g = x_g @ weight[g].
    Rows past the last group are zero."""
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gmm: expected x [M, K] and weight [G, K, N], got {tuple(x.shape)} and {tuple(weight.shape)}")
    sizes = group_sizes(group_list, group_list_type, weight.shape[0], x.shape[0])
    parts = [x_g @ weight[g] for g, x_g in enumerate(torch.split(x, sizes + [x.shape[0] - sum(sizes)])[:-1])]
    rest = x.new_zeros(x.shape[0] - sum(sizes), weight.shape[2])
    return torch.cat(parts + [rest], 0)


def matmul_add_fp32(x, dy, main_grad):
    """In place main_grad += dy^T @ x in fp32 (leading dims of x/dy flattened); returns main_grad."""
    if main_grad.dtype != torch.float32:
        raise ValueError(f"matmul_add_fp32: main_grad must be float32, got {main_grad.dtype}")
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    if main_grad.shape != (dy2.shape[1], x2.shape[1]) or x2.shape[0] != dy2.shape[0]:
        raise ValueError(f"matmul_add_fp32: main_grad {tuple(main_grad.shape)} != dy^T @ x shape "
                         f"({dy2.shape[1]}, {x2.shape[1]}) or row counts differ")
    main_grad.add_(dy2.float().t() @ x2.float())
    return main_grad


def grouped_matmul_add_fp32(x, dy, group_list, main_grad, group_list_type: int = 0):
    """In place main_grad (read as [G, K, N]) [g] += x_g^T @ dy_g in fp32: the weight gradient of gmm
    accumulated into Megatron's fp32 main_grad. x [M, K], dy [M, N] rows grouped as gmm's (rows past
    the last group add nothing); G = len(group_list). Returns main_grad."""
    if main_grad.dtype != torch.float32:
        raise ValueError(f"grouped_matmul_add_fp32: main_grad must be float32, got {main_grad.dtype}")
    if x.dim() != 2 or dy.dim() != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(f"grouped_matmul_add_fp32: expected x [M, K] and dy [M, N], got {tuple(x.shape)} "
                         f"and {tuple(dy.shape)}")
    num_groups = len(group_list)
    if main_grad.numel() != num_groups * x.shape[1] * dy.shape[1]:
        raise ValueError(f"grouped_matmul_add_fp32: main_grad {tuple(main_grad.shape)} does not hold "
                         f"[{num_groups}, {x.shape[1]}, {dy.shape[1]}] (groups, K, N)")
    sizes = group_sizes(group_list, group_list_type, num_groups, x.shape[0])
    per_group = main_grad.view(num_groups, x.shape[1], dy.shape[1])      # a view: the adds land in main_grad
    start = 0
    for g, size in enumerate(sizes):
        per_group[g].addmm_(x[start:start + size].t().float(), dy[start:start + size].float())
        start += size
    return main_grad


# -- MoE token permutation ------------------------------------------------------------------------
def moe_permute(tokens, routing_map):
    """tokens [T, H], routing_map [T, E] bool -> (permuted [P, H] expert-major, token order within
    an expert; sorted_indices [P] = source token of each permuted row)."""
    if routing_map.dim() != 2 or tokens.shape[0] != routing_map.shape[0]:
        raise ValueError(f"moe_permute: routing_map {tuple(routing_map.shape)} must be [T, E] with "
                         f"T = tokens rows {tokens.shape[0]}")
    num_tokens, num_experts = routing_map.shape
    token_ids = torch.arange(num_tokens, device=tokens.device).unsqueeze(0).expand(num_experts, -1)
    sorted_indices = token_ids.masked_select(routing_map.bool().t())
    return tokens.index_select(0, sorted_indices), sorted_indices


def moe_unpermute(permuted_tokens, sorted_indices, probs, restore_shape, *, routing_map=None):
    """Scatter-add rows back to restore_shape [T, H], each weighted by its prob. probs: None (1),
    [P] per permuted row, or [T, E] together with routing_map."""
    if probs is not None and probs.dim() == 2:
        if routing_map is None:
            raise ValueError("moe_unpermute: [T, E] probs need the routing_map that made the permutation")
        probs = probs.t().masked_select(routing_map.bool().t())
    rows = permuted_tokens
    if probs is not None:   # weighted rows are summed in fp32 (as Megatron's unpermute), then cast
        if probs.shape[0] != permuted_tokens.shape[0]:
            raise ValueError(f"moe_unpermute: {probs.shape[0]} probs for {permuted_tokens.shape[0]} rows")
        rows = _wide(permuted_tokens) * _wide(probs).unsqueeze(-1)
    out = rows.new_zeros(restore_shape)
    return out.index_add(0, sorted_indices, rows).to(permuted_tokens.dtype)


# -- dropout + add + layer norm -------------------------------------------------------------------
def dropout_add_layer_norm(x0, residual, weight, bias, dropout_p: float, epsilon: float, *, rowscale=None,
                           layerscale=None, prenorm: bool = False, residual_in_fp32: bool = False,
                           return_dropout_mask: bool = False):
    """z = dropout(x0 * rowscale * layerscale) + residual; out = layer_norm(z, weight, bias, eps).
    Returns (out, mask) or, with prenorm, (out, z, mask); mask is None unless asked for."""
    x = x0
    if rowscale is not None:
        x = x * rowscale.unsqueeze(-1)
    if layerscale is not None:
        x = x * layerscale
    keep = None
    if dropout_p > 0:
        keep = torch.rand_like(x, dtype=torch.float32) >= dropout_p
        x = x * keep / (1.0 - dropout_p)
    z = _wide(x) + _wide(residual) if residual is not None else _wide(x)
    out = F.layer_norm(z, (z.shape[-1],), _wide(weight) if weight is not None else None,
                       _wide(bias) if bias is not None else None, epsilon).to(x0.dtype)
    z = z if residual_in_fp32 else z.to(x0.dtype)
    mask = keep if return_dropout_mask else None
    return (out, z, mask) if prenorm else (out, mask)
