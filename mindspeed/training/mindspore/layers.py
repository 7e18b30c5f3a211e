"""Tensor-parallel building blocks with hand-written backward (Megatron's mappings).

MindSpore's own AllReduce backward all-reduces the gradient again, which doubles TP gradients;
so every collective inside the model goes through the backend's differentiable variants
(copy_to_region, reduce_from_region, all_gather_autograd, reduce_scatter_autograd) and the
vocab-parallel cross-entropy is a custom op with Megatron's analytic backward.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import ops

from mindspeed.backends.mindspore.precision import fp32_compute
from mindspeed.training.mindspore.parallel import ParallelState

_MATMUL_T = fp32_compute(ops.MatMul(transpose_b=True))     # bf16 on CPU: in fp32 (precision.py)
_GATHER = fp32_compute(ops.gather)


def linear(x, weight):
    """x [..., k] @ weight[n, k]^T as one 2-d MatMul (MindSpore CPU's n-d matmul is much slower)."""
    return _MATMUL_T(x.reshape(-1, x.shape[-1]), weight).reshape(tuple(x.shape[:-1]) + (weight.shape[0],))


def stacked(weights: list, transpose: bool = True):
    """The [G, K, N] gmm operand of G weights [N, K] (transpose; else [G, N, K]), through Concat:
    MindSpore's CPU has a bf16 Concat, no bf16 Stack."""
    return ops.cat([(w.T if transpose else w).expand_dims(0) for w in weights], 0)


def column_parallel(backend, ps: ParallelState, x, weight, bias=None):
    """x [s(/tp with SP), b, h] -> x_full @ W_local^T: each TP rank computes its output columns."""
    if ps.tp_size > 1 and ps.tp_linear is not None:
        y = ps.tp_linear.column(x, weight, ps.tp_group, ps.sequence_parallel)
        return y if bias is None else y + bias
    if ps.tp_size > 1:
        x = (backend.comm.all_gather_autograd(x, 0, ps.tp_group) if ps.sequence_parallel
             else backend.comm.copy_to_region(x, ps.tp_group))
    y = _weight_linear(ps, x, weight)
    return y if bias is None else y + bias


def _weight_linear(ps: ParallelState, x, weight):
    return linear(x, weight) if ps.main_grads is None or not ps.main_grads.dense else ps.main_grads.linear(x, weight)


def row_parallel(backend, ps: ParallelState, x, weight, bias=None):
    """x [s, b, k/tp] -> sum over TP ranks of x_local @ W_local^T (scattered by seq with SP)."""
    if ps.tp_size > 1 and ps.tp_linear is not None:
        y = ps.tp_linear.row(x, weight, ps.tp_group, ps.sequence_parallel)
        return y if bias is None else y + bias
    y = _weight_linear(ps, x, weight)
    if ps.tp_size > 1:
        y = (backend.comm.reduce_scatter_autograd(y, 0, ps.tp_group) if ps.sequence_parallel
             else backend.comm.reduce_from_region(y, ps.tp_group))
    return y if bias is None else y + bias      # bias is replicated: added once, after the sum


def vocab_parallel_embedding(backend, ps: ParallelState, tokens, weight):
    """tokens [b, s] -> [s(/tp with SP), b, h]; rank r holds vocab rows [r*V/tp, (r+1)*V/tp)."""
    tokens = tokens.T
    if ps.tp_size == 1:
        return _GATHER(weight, tokens, 0)
    rows = weight.shape[0]
    start = ps.tp_rank * rows
    in_range = ops.logical_and(tokens >= start, tokens < start + rows)
    local = ops.where(in_range, tokens - start, ops.zeros_like(tokens))
    emb = _GATHER(weight, local, 0) * in_range.astype(weight.dtype).expand_dims(-1)
    return (backend.comm.reduce_scatter_autograd(emb, 0, ps.tp_group) if ps.sequence_parallel
            else backend.comm.reduce_from_region(emb, ps.tp_group))


def vocab_parallel_cross_entropy(backend, ps: ParallelState, logits, target):
    """Per-token loss [s, b] from vocab-sharded logits [s, b, V/tp], computed in fp32 (fp16 logits too,
    as Megatron's)."""
    comm, group = backend.comm, ps.tp_group
    vocab_local = logits.shape[-1]
    start = ps.tp_rank * vocab_local
    logits_dtype = logits.dtype

    def forward(ctx, logits, target):
        logits = logits.astype(ms.float32)
        # the shift cancels out of the loss: no gradient through it (graph autodiff of a traced
        # forward differentiates this function, not `backward`: it must come out the same)
        row_max = ops.stop_gradient(logits.max(axis=-1))
        row_max = comm.all_reduce(row_max, "max", group) if ps.tp_size > 1 else row_max
        shifted = logits - row_max.expand_dims(-1)
        in_range = ops.logical_and(target >= start, target < start + vocab_local)
        local = ops.where(in_range, target - start, ops.zeros_like(target))
        picked = ops.gather_elements(shifted, -1, local.expand_dims(-1)).squeeze(-1)
        picked = picked * in_range.astype(ms.float32)
        exp = ops.exp(shifted)
        sum_exp = exp.sum(-1)
        if ps.tp_size > 1:      # each rank's share of the sum; its gradient is the sum's own
            picked = comm.reduce_from_region(picked, group)
            sum_exp = comm.reduce_from_region(sum_exp, group)
        ctx.save(exp / sum_exp.expand_dims(-1), local, in_range)
        return ops.log(sum_exp) - picked

    def backward(ctx, dloss):
        softmax, local, in_range = ctx.saved
        onehot = ops.one_hot(local, vocab_local, ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32))
        grad = (softmax - onehot * in_range.astype(ms.float32).expand_dims(-1)) * dloss.expand_dims(-1)
        return grad.astype(logits_dtype), None     # fp16 logits (--fp16) take an fp16 gradient

    return backend.autograd.custom_op(forward, backward)(logits, target)
