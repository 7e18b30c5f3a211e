"""CUDA fast paths (catalog.FAST_PATHS["cuda"] lists which kernels use them); the others run the
reference on CUDA tensors.

- attention: torch's memory-efficient CUDA attention (O(s) memory, any head dim, v's its own as in
  multi-latent attention, fp32/fp16/bf16,
  an additive bias for masks, bands and alibi, logsumexp returned) behind an autograd.Function
  whose backward also carries the gradient of the softmax statistics, so ring attention can
  differentiate through ring_attention_update: d lse / d scores is the softmax P itself, so the
  statistics' share of dq is scale * dlse * (P @ K), one more forward with K as the values, and of
  dk scale * P^T (dlse * Q), the values' gradient of one more backward. Dropout runs the reference.
  Measured against the reference on a GPU: tests_extend/benchmarks/bench_cuda_attention.py
  (docs/gpu.md).
Semantics are those of reference.py; tests_extend/gpu compares both, forward and backward.
"""
from __future__ import annotations

import torch

from mindspeed.backends.torch.kernels import reference
from mindspeed.backends.torch.kernels.reference import *  # noqa: F401,F403  (the kernels without a CUDA path)

_efficient_fwd = torch.ops.aten._scaled_dot_product_efficient_attention
_efficient_bwd = torch.ops.aten._scaled_dot_product_efficient_attention_backward
BIAS_ALIGNMENT = 16        # the kernel reads the bias' rows in aligned blocks: pad its last dim


def _aligned_bias(bias, shape):
    """`bias` broadcast to `shape` [b, n, sq, skv], stored with its last dim padded to the kernel's alignment."""
    skv = shape[-1]
    padded = torch.zeros(*bias.shape[:-1], -(-skv // BIAS_ALIGNMENT) * BIAS_ALIGNMENT, dtype=bias.dtype,
                         device=bias.device)
    padded[..., :skv] = bias
    while padded.dim() < 4:
        padded = padded.unsqueeze(0)
    return padded[..., :skv].expand(shape)


class _EfficientAttention(torch.autograd.Function):
    """[b, n, s, d] attention with an additive bias (or is_causal); outputs (out, logsumexp)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, causal, scale, groups):
        k, v = reference.repeat_kv(k, v, groups)
        out, lse, seed, offset = _efficient_fwd(q, k, v, bias, True, 0.0, causal, scale=scale)
        ctx.save_for_backward(q, k, v, bias, out, lse, seed, offset)
        ctx.causal, ctx.scale, ctx.groups = causal, scale, groups
        ctx.set_materialize_grads(False)
        return out, lse[..., :q.shape[2]]

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, bias, out, lse, seed, offset = ctx.saved_tensors

        def kernel_bwd(d_out, values, output, needed):
            return _efficient_bwd(d_out.contiguous(), q, k, values, bias, output, lse, seed, offset, 0.0, needed,
                                  ctx.causal, scale=ctx.scale)
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, _ = kernel_bwd(dout, v, out, [True, True, True, False])
        if dlse is not None and bool(torch.any(dlse)):
            weight = dlse.unsqueeze(-1)                                  # [b, n, sq, 1], fp32
            p_k = _efficient_fwd(q, k, k, bias, False, 0.0, ctx.causal, scale=ctx.scale)[0]   # P @ K
            pt_wq = kernel_bwd((weight * q.float()).to(q.dtype), k, p_k, [False, False, True, False])[2]
            dq = (dq.float() + ctx.scale * weight * p_k.float()).to(q.dtype)
            dk = (dk.float() + ctx.scale * pt_wq.float()).to(k.dtype)
        dk, dv = reference.sum_kv_groups(dk, dv, ctx.groups)
        return dq, dk, dv, None, None, None, None


def _attention_bnsd(q, k, v, *, scale, mask, causal, pre_tokens, next_tokens, alibi):
    plain_causal, bias, empty_rows = reference.fast_path_bias(q, k, mask=mask, causal=causal, pre_tokens=pre_tokens,
                                                              next_tokens=next_tokens, alibi=alibi,
                                                              unmask_empty_rows=True)
    if bias is not None:
        bias = _aligned_bias(bias, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    out, lse = _EfficientAttention.apply(q, k, v, bias, plain_causal, scale, q.shape[1] // k.shape[1])
    if empty_rows is not None and bool(empty_rows.any()):          # a row that attends to nothing: 0
        out = out.masked_fill(empty_rows.expand(lse.shape).unsqueeze(-1), 0.0)
    return (out, *reference.stats_from_logsumexp(lse, empty_rows))


def attention(q, k, v, **kwargs):
    """The reference's contract (its keywords), except that the stats come back as (logsumexp, 1) —
    the same logsumexp = max + log(sum). Dropout and tensors off CUDA use the reference."""
    return reference.fast_attention(_attention_bnsd, "cuda", q, k, v, **kwargs)
