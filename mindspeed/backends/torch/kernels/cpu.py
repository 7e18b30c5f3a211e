"""Fast CPU paths (catalog.FAST_PATHS["cpu"] lists which kernels use them).

- rms_norm, swiglu, rope: fused C++ forward and backward (csrc/fused_cpu.cpp, built just in time),
  each one pass over memory instead of the reference's chain of elementwise ops; the reference
  runs when the build is unavailable or an input is outside what the C++ kernel handles.
- attention: torch's CPU flash-attention kernel (O(s) memory, returns logsumexp) behind a custom
  autograd.Function whose backward also carries the gradient of the softmax statistics, so ring
  attention can differentiate through ring_attention_update. Plain causal self-attention of up to
  1024 tokens runs block-causal batched GEMMs instead (64-query blocks against their key prefix,
  about half the FLOPs of full attention, probabilities kept for backward within a memory cap,
  mask + softmax + logsumexp in one C++ pass): the BLAS GEMMs outrun the flash kernel, 1.3-1.7x
  fwd+bwd at s 256-1024 (tests_extend/benchmarks/bench_kernels.py); flash is as fast beyond.
- gmm: each group's GEMM writes into its rows of one output, backward likewise (no concatenation,
  no full-size zero weight gradient per group as the reference's autograd builds).
- moe_permute / moe_unpermute: the scatter-adds (unpermute forward, permute backward) become
  embedding_bag gather-sums, one parallel pass per token with no zero-filled buffer (as fast as the
  reference at one thread: both are memory-bound).
- not here: matmul_add_fp32 as one in-place addmm measured ~1.06x the reference (GEMM-bound),
  so the reference serves it; ring_attention_update likewise.
Semantics are those of reference.py; tests compare both, forward and backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mindspeed.backends.torch.kernels import reference
from mindspeed.backends.torch.kernels.csrc import fused_ops

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# -- rms_norm --------------------------------------------------------------------------------------
class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, eps):
        y, rstd = fused_ops().rms_norm_fwd(x, gamma, eps)
        ctx.save_for_backward(x, gamma, rstd)
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    def backward(ctx, dy, _drstd):
        x, gamma, rstd = ctx.saved_tensors
        dx, dgamma = fused_ops().rms_norm_bwd(dy, x, gamma, rstd)
        return dx, dgamma, None


def rms_norm(x, gamma, eps: float = 1e-6):
    if fused_ops() is None or x.dtype != gamma.dtype or x.dtype not in _FUSED_DTYPES or x.device.type != "cpu":
        return reference.rms_norm(x, gamma, eps)
    if gamma.shape[-1] != x.shape[-1] or gamma.dim() != 1:
        return reference.rms_norm(x, gamma, eps)   # raises the reference's clear error
    return _RmsNorm.apply(x, gamma, float(eps))


# -- swiglu ----------------------------------------------------------------------------------------
class _Swiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return fused_ops().swiglu_fwd(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return fused_ops().swiglu_bwd(dy, x)


def swiglu(x, dim: int = -1):
    last = dim in (-1, x.dim() - 1)
    if fused_ops() is None or not last or x.dtype not in _FUSED_DTYPES or x.shape[-1] % 2 or x.device.type != "cpu":
        return reference.swiglu(x, dim)
    return _Swiglu.apply(x)


# -- rope ------------------------------------------------------------------------------------------
class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, mode):
        ctx.save_for_backward(cos, sin)
        ctx.mode = mode
        return fused_ops().rope_apply(x, cos, sin, mode, False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return fused_ops().rope_apply(dy, cos, sin, ctx.mode, True), None, None, None


def rope(x, cos, sin, mode: int = 0):
    rot = cos.shape[-1]
    simple = (mode in (0, 1) and rot % 2 == 0 and 0 < rot <= x.shape[-1] and sin.shape == cos.shape
              and cos.dim() <= x.dim() and x.dtype in _FUSED_DTYPES and x.device.type == "cpu")
    if fused_ops() is None or not simple or cos.requires_grad or sin.requires_grad:
        return reference.rope(x, cos, sin, mode)
    try:
        torch.broadcast_shapes(cos.shape[:-1], x.shape[:-1])
    except RuntimeError:
        return reference.rope(x, cos, sin, mode)    # raises the reference's error
    return _Rope.apply(x, cos, sin, mode)


# -- attention -------------------------------------------------------------------------------------
_flash_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _pad_channel(t, value):
    """Append one channel (a constant or a per-row tensor) to the last dim."""
    extra = value.unsqueeze(-1).to(t.dtype) if torch.is_tensor(value) else torch.full_like(t[..., :1], value)
    return torch.cat((t, extra), -1)


class _FlashAttention(torch.autograd.Function):
    """[b, n, s, d] attention with an additive float mask (or is_causal); outputs (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, float_mask, causal, scale, groups):
        k, v = reference.repeat_kv(k, v, groups)
        out, lse = _flash_fwd(q, k, v, 0.0, causal, attn_mask=float_mask, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, float_mask)
        ctx.causal, ctx.scale, ctx.groups = causal, scale, groups
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, float_mask = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is None or not torch.any(dlse):
            dq, dk, dv = _flash_bwd(dout.contiguous(), q, k, v, out, lse, 0.0, ctx.causal,
                                    attn_mask=float_mask, scale=ctx.scale)
        else:
            # d lse / d scores = softmax: fold it into the kernel's row term D = rowsum(dO*O) by one
            # extra channel (q, k, v: 0, dO: 1, O: -dlse), so D' = D - dlse and
            # dS = P (dP - D + dlse). Costs O(s*d) copies, not another pass over s^2.
            d = q.shape[-1]
            dq, dk, dv = _flash_bwd(_pad_channel(dout, 1.0), _pad_channel(q, 0.0), _pad_channel(k, 0.0),
                                    _pad_channel(v, 0.0), _pad_channel(out, -dlse), lse, 0.0, ctx.causal,
                                    attn_mask=float_mask, scale=ctx.scale)
            dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d]
        dk, dv = reference.sum_kv_groups(dk, dv, ctx.groups)
        return dq, dk, dv, None, None, None, None


# Block-causal GEMM attention: where it beats flash (bench_kernels.py, fwd+bwd; docs/performance.md).
GEMM_BLOCK = 64                      # query rows per GEMM: 64 beat 32 and 128 at s 128-1024
GEMM_MAX_SEQ = 1024                  # flash is as fast from 2048 on, with O(s) memory
GEMM_MAX_SAVED_BYTES = 64 << 20      # probabilities kept for backward, per call
GEMM_MIN_SEQ_X_DIM = 8192            # below (e.g. s 128 at head dim 32) flash is as fast
GEMM_MAX_THREADS = 1                 # the block loop's small GEMMs gain little from a second thread; flash does


def _block_starts(s: int) -> range:
    return range(0, s, GEMM_BLOCK)


def gemm_attention_pays(q, k, plain_causal: bool) -> bool:
    """Plain causal self-attention [b, n, s, d] in fp32/bf16 on at most GEMM_MAX_THREADS torch
    threads, s at most GEMM_MAX_SEQ, s * d at least GEMM_MIN_SEQ_X_DIM, whose kept probabilities
    (the lower block triangle) fit GEMM_MAX_SAVED_BYTES."""
    b, n, s, d = q.shape
    if not plain_causal or k.shape[2] != s or q.dtype not in (torch.float32, torch.bfloat16) \
            or s > GEMM_MAX_SEQ or s * d < GEMM_MIN_SEQ_X_DIM or torch.get_num_threads() > GEMM_MAX_THREADS:
        return False
    kept = sum(min(GEMM_BLOCK, s - r0) * min(r0 + GEMM_BLOCK, s) for r0 in _block_starts(s))
    return b * n * kept * q.element_size() <= GEMM_MAX_SAVED_BYTES


class _BlockCausalAttention(torch.autograd.Function):
    """Causal [b, n, s, d] attention as batched GEMMs over each query block's key prefix; outputs
    (out, lse fp32) like _FlashAttention. Keeps the softmax probabilities for backward."""

    @staticmethod
    def forward(ctx, q, k, v, scale, groups):
        k, v = reference.repeat_kv(k, v, groups)
        b, n, s, d = q.shape
        q3, k3, v3 = (t.reshape(b * n, s, t.shape[-1]) for t in (q, k, v))   # v's head size may be its own
        out = v3.new_empty(b * n, s, v3.shape[-1])
        lse = torch.empty(b * n, s, dtype=torch.float32)
        future = torch.ones(GEMM_BLOCK, GEMM_BLOCK, dtype=torch.bool).triu_(1)
        ops = fused_ops()      # the C++ causal softmax, or None: the same in torch ops
        probs = []
        for r0 in _block_starts(s):
            r1 = min(r0 + GEMM_BLOCK, s)
            p = torch.baddbmm(q3.new_empty(b * n, r1 - r0, r1), q3[:, r0:r1], k3[:, :r1].transpose(1, 2),
                              beta=0, alpha=scale)
            if ops is not None:
                lse[:, r0:r1] = ops.causal_softmax_(p, r0)
            else:
                p[:, :, r0:].masked_fill_(future[:r1 - r0, :r1 - r0], float("-inf"))
                row_max = p.amax(-1)
                p = torch.softmax(p, -1)
                # logsumexp = max - log(p at the max): p there is 1/sum, never underflows
                torch.sub(row_max.float(), p.amax(-1).float().log_(), out=lse[:, r0:r1])
            torch.bmm(p, v3[:, :r1], out=out[:, r0:r1])
            probs.append(p)
        ctx.save_for_backward(q3, k3, v3, out, *probs)
        ctx.shape, ctx.scale, ctx.groups = (b, n, s, d), scale, groups
        ctx.set_materialize_grads(False)
        return out.view(b, n, s, out.shape[-1]), lse.view(b, n, s)

    @staticmethod
    def backward(ctx, dout, dlse):
        q3, k3, v3, out, *probs = ctx.saved_tensors
        b, n, s, d = ctx.shape
        dout = torch.zeros_like(out) if dout is None else dout.reshape(b * n, s, out.shape[-1])
        # dS = P * (dP - D), D = rowsum(dO * O) - dlse (d lse / d S = P)
        row_term = (dout.float() * out.float()).sum(-1)
        if dlse is not None:
            row_term = row_term - dlse.reshape(b * n, s)
        ops = fused_ops()
        if ops is None:
            row_term = row_term.to(q3.dtype)
        dq, dk, dv = torch.empty_like(q3), torch.zeros_like(k3), torch.zeros_like(v3)
        for p, r0 in zip(probs, _block_starts(s)):
            r1 = min(r0 + GEMM_BLOCK, s)
            dv[:, :r1].baddbmm_(p.transpose(1, 2), dout[:, r0:r1])
            dscores = torch.bmm(dout[:, r0:r1], v3[:, :r1].transpose(1, 2))
            if ops is not None:
                ops.causal_softmax_grad_(dscores, p, row_term[:, r0:r1], r0)
            else:
                dscores.sub_(row_term[:, r0:r1, None]).mul_(p)
            torch.bmm(dscores, k3[:, :r1], out=dq[:, r0:r1])
            dk[:, :r1].baddbmm_(dscores.transpose(1, 2), q3[:, r0:r1], alpha=ctx.scale)
        dq.mul_(ctx.scale)
        dq, dk, dv = (t.view(b, n, s, t.shape[-1]) for t in (dq, dk, dv))
        dk, dv = reference.sum_kv_groups(dk, dv, ctx.groups)
        return dq, dk, dv, None, None


def _attention_bnsd(q, k, v, *, scale, mask, causal, pre_tokens, next_tokens, alibi):
    plain_causal, bias, empty_rows = reference.fast_path_bias(q, k, mask=mask, causal=causal, pre_tokens=pre_tokens,
                                                              next_tokens=next_tokens, alibi=alibi)
    groups = q.shape[1] // k.shape[1]
    if gemm_attention_pays(q, k, plain_causal):
        out, lse = _BlockCausalAttention.apply(q, k, v, scale, groups)
    else:
        # torch's CPU flash kernel takes one head size: an unequal v (multi-latent attention) gets zero
        # channels (or q and k do, leaving the scores as they are), cut from the output again
        width, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
        q, k, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        out, lse = _FlashAttention.apply(q, k, v, bias, plain_causal, scale, groups)
        out = out if dv == width else out[..., :dv]
    return (out, *reference.stats_from_logsumexp(lse, empty_rows))   # the kernel reports lse 0 in empty rows


def attention(q, k, v, **kwargs):
    """The reference's contract (its keywords), except that the stats come back as (logsumexp, 1) —
    the same logsumexp = max + log(sum). Dropout (unsupported by the CPU kernel) uses the reference."""
    return reference.fast_attention(_attention_bnsd, "cpu", q, k, v, **kwargs)


# -- gmm -------------------------------------------------------------------------------------------
class _Gmm(torch.autograd.Function):
    """Each group's GEMM writes straight into its rows of one output (no per-group results to
    concatenate) and backward writes dx rows and dweight[g] in place; the reference's autograd
    instead builds a full-size zero gradient of `weight` for every `weight[g]` it indexed and sums
    them."""

    @staticmethod
    def forward(ctx, x, weight, sizes):
        ctx.save_for_backward(x, weight)
        ctx.sizes = sizes
        out = x.new_empty(x.shape[0], weight.shape[2])
        a = 0
        for g, s in enumerate(sizes):
            if s:
                torch.mm(x[a:a + s], weight[g], out=out[a:a + s])
            a += s
        out[a:].zero_()                          # rows past the last group
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = x.new_empty(x.shape)
        if ctx.needs_input_grad[1]:
            dw = weight.new_empty(weight.shape)
        a = 0
        for g, s in enumerate(ctx.sizes):
            if dx is not None and s:
                torch.mm(dy[a:a + s], weight[g].t(), out=dx[a:a + s])
            if dw is not None:
                if s:
                    torch.mm(x[a:a + s].t(), dy[a:a + s], out=dw[g])
                else:
                    dw[g].zero_()
            a += s
        if dx is not None:
            dx[a:].zero_()
        return dx, dw, None


def gmm(x, weight, group_list, group_list_type: int = 0):
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype:
        return reference.gmm(x, weight, group_list, group_list_type)     # reference raises or casts
    sizes = reference.group_sizes(group_list, group_list_type, weight.shape[0], x.shape[0])
    return _Gmm.apply(x, weight, sizes)


# -- moe_permute / moe_unpermute -------------------------------------------------------------------
# Permuted row p holds token sorted_indices[p]. Gathering a token's rows back is a weighted
# bag-sum: embedding_bag over the permuted rows, bags = tokens (rows listed token by token), one
# parallel pass with no zero-filled [T, H] buffer and no serial scatter-add (index_add).
_BAG_DTYPES = (torch.float32, torch.float64)


def _bags(sorted_indices, num_tokens):
    """(rows ordered by token, offset of each token's first row) for embedding_bag."""
    by_token = torch.argsort(sorted_indices, stable=True)
    counts = torch.bincount(sorted_indices, minlength=num_tokens)
    return by_token, torch.cumsum(counts, 0) - counts


def _bag_sum(rows, by_token, offsets, weights=None):
    return torch.nn.functional.embedding_bag(by_token, rows, offsets, mode="sum", per_sample_weights=weights)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, sorted_indices):
        ctx.save_for_backward(sorted_indices)
        ctx.num_tokens = tokens.shape[0]
        return tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx, dperm):
        (sorted_indices,) = ctx.saved_tensors
        by_token, offsets = _bags(sorted_indices, ctx.num_tokens)
        return _bag_sum(dperm.contiguous(), by_token, offsets), None


def moe_permute(tokens, routing_map):
    if tokens.dim() != 2 or tokens.dtype not in _BAG_DTYPES or routing_map.dim() != 2 \
            or tokens.shape[0] != routing_map.shape[0]:
        return reference.moe_permute(tokens, routing_map)
    # expert-major, token order within an expert: the nonzeros of the transposed map, row by row
    sorted_indices = routing_map.bool().t().nonzero()[:, 1]
    return _Permute.apply(tokens, sorted_indices), sorted_indices


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, sorted_indices, probs, num_tokens):
        by_token, offsets = _bags(sorted_indices, num_tokens)
        weights = None if probs is None else probs.index_select(0, by_token)
        ctx.save_for_backward(permuted, sorted_indices, probs)
        return _bag_sum(permuted.contiguous(), by_token, offsets, weights)

    @staticmethod
    def backward(ctx, dout):
        permuted, sorted_indices, probs = ctx.saved_tensors
        drows = dout.index_select(0, sorted_indices)          # each row's token gradient
        dprobs = None
        if probs is not None and ctx.needs_input_grad[2]:
            dprobs = (drows * permuted).sum(-1)
        dperm = drows if probs is None else drows * probs.unsqueeze(-1)
        return dperm, None, dprobs, None


def moe_unpermute(permuted_tokens, sorted_indices, probs, restore_shape, *, routing_map=None):
    restore = tuple(restore_shape)
    if (permuted_tokens.dim() != 2 or permuted_tokens.dtype not in _BAG_DTYPES or len(restore) != 2
            or restore[1] != permuted_tokens.shape[1]
            or (probs is not None and (probs.dim() != 1 or probs.dtype != permuted_tokens.dtype))):
        # [T, E] probs, other dtypes (fp32 accumulation then cast) and bad shapes: the reference
        return reference.moe_unpermute(permuted_tokens, sorted_indices, probs, restore_shape,
                                       routing_map=routing_map)
    if probs is not None and probs.shape[0] != permuted_tokens.shape[0]:
        return reference.moe_unpermute(permuted_tokens, sorted_indices, probs, restore_shape)
    return _Unpermute.apply(permuted_tokens, sorted_indices, probs, restore[0])
