"""Computation-over-communication (CoC) for tensor-parallel linear layers (--use-ascend-coc).

The GEMM of a column- or row-parallel linear is split along the first (sequence) dim into
`chunks` pieces; each piece's collective is started asynchronously (comm.*_async) as soon as its
input or output exists, so it runs while the next piece's GEMM computes. Forward and backward:

  layer, mode        forward                               backward
  column, all-reduce Y = X W^T (no communication)          dX_i = dY_i W, all_reduce(dX_i) async
  column, SP         all_gather(X_i) async, Y_i = X_i W^T  all_gather(X_i) for dW async; dX_i
                                                           = dY_i W, reduce_scatter(dX_i) async
  row, all-reduce    Y_i = X_i W^T, all_reduce(Y_i) async  dX = dY W (no communication)
  row, SP            Y_i = X_i W^T, reduce_scatter async   all_gather(dY_i) async, dX_i = dY_i W

Sequence-parallel chunks are interleaved: the full sequence is n blocks of L rows (block r is
rank r's shard) and chunk i is rows [a_i, b_i) of every block, so a chunk's all-gather or
reduce-scatter is a plain collective over those n pieces. The weight gradient is one GEMM over
the whole (re-assembled) input, as the non-overlapped path computes it.

Written against the backend interface (comm, autograd.custom_op, kernels.matmul_add_fp32) of the
backend a Coc is made with (the run's: the hooks make one at apply) and tensor methods torch and
MindSpore tensors share (slicing, reshape, matmul, new_zeros).
"""
from __future__ import annotations

import functools


def bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """[a, b) row ranges of `chunks` near-equal pieces of `rows` (no empty piece)."""
    chunks = max(1, min(chunks, rows))
    base, extra = divmod(rows, chunks)
    out, a = [], 0
    for i in range(chunks):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def take_interleaved(full, n: int, block: int, a: int, b: int):
    """Rows [a, b) of each of the n blocks of `full`, stacked block after block: [n*(b-a), ...]."""
    c = b - a
    out = full.new_zeros((n * c,) + tuple(full.shape[1:]))
    for r in range(n):
        out[r * c:(r + 1) * c] = full[r * block + a:r * block + b]
    return out


def put_interleaved(full, part, n: int, block: int, a: int, b: int) -> None:
    """Inverse of take_interleaved: writes part's n pieces to rows [a, b) of each block."""
    c = b - a
    for r in range(n):
        full[r * block + a:r * block + b] = part[r * c:(r + 1) * c]


def _gemm(x, weight):       # x [..., k] @ weight[o, k]^T
    return x.matmul(weight.transpose(1, 0))


def _wgrad(kernels, weight, x, dy, accumulate: bool):
    """dW = dy^T x over all rows, or (gradient accumulation fusion) added into weight.main_grad."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    if accumulate and getattr(weight, "main_grad", None) is not None:
        kernels.matmul_add_fp32(x2, dy2, weight.main_grad)
        if hasattr(weight, "grad_added_to_main_grad"):
            # as Megatron: a placeholder gradient keeps DDP's hooks on the main thread
            weight.grad_added_to_main_grad = True
            return weight.new_zeros(tuple(weight.shape))
        return None
    return dy2.transpose(1, 0).matmul(x2)


# -- column-parallel ------------------------------------------------------------------------------

def _column_forward(coc, ctx, x, weight, group, sequence_parallel, chunks, accumulate):
    ctx.save(x, weight)
    ctx.opts = (group, sequence_parallel, chunks, accumulate)
    if not sequence_parallel:
        return _gemm(x, weight)
    comm = coc.comm
    n, rows = comm.world_size(group), x.shape[0]
    pieces = bounds(rows, chunks)
    pending = [comm.all_gather_async(x[a:b], 0, group) for a, b in pieces]   # all in flight at once
    out = x.new_zeros((n * rows,) + tuple(x.shape[1:-1]) + (weight.shape[0],))
    for (a, b), handle in zip(pieces, pending):
        put_interleaved(out, _gemm(handle.wait(), weight), n, rows, a, b)
    return out


def _column_backward(coc, ctx, dy):
    x, weight = ctx.saved
    group, sequence_parallel, chunks, accumulate = ctx.opts
    comm = coc.comm
    n, rows = comm.world_size(group), x.shape[0]
    pieces = bounds(rows, chunks)
    dx = x.new_zeros(tuple(x.shape))
    if sequence_parallel:
        gathers = [comm.all_gather_async(x[a:b], 0, group) for a, b in pieces]     # for dW
        reduces = [comm.reduce_scatter_async(take_interleaved(dy, n, rows, a, b).matmul(weight), 0, group)
                   for a, b in pieces]
        total = x.new_zeros((n * rows,) + tuple(x.shape[1:]))
        for (a, b), handle in zip(pieces, gathers):
            put_interleaved(total, handle.wait(), n, rows, a, b)
    else:
        reduces = [comm.all_reduce_async(dy[a:b].matmul(weight), "sum", group) for a, b in pieces]
        total = x
    dw = _wgrad(coc.kernels, weight, total, dy, accumulate)      # runs while the last reductions are in flight
    for (a, b), handle in zip(pieces, reduces):
        dx[a:b] = handle.wait()
    return dx, dw, None, None, None, None


# -- row-parallel ---------------------------------------------------------------------------------

def _row_forward(coc, ctx, x, weight, group, sequence_parallel, chunks, accumulate):
    ctx.save(x, weight)
    ctx.opts = (group, sequence_parallel, chunks, accumulate)
    comm = coc.comm
    n = comm.world_size(group)
    shape = tuple(x.shape[1:-1]) + (weight.shape[0],)
    if sequence_parallel:
        rows = x.shape[0] // n
        pieces = bounds(rows, chunks)
        pending = [comm.reduce_scatter_async(_gemm(take_interleaved(x, n, rows, a, b), weight), 0, group)
                   for a, b in pieces]
        out = x.new_zeros((rows,) + shape)
    else:
        pieces = bounds(x.shape[0], chunks)
        pending = [comm.all_reduce_async(_gemm(x[a:b], weight), "sum", group) for a, b in pieces]
        out = x.new_zeros((x.shape[0],) + shape)
    for (a, b), handle in zip(pieces, pending):
        out[a:b] = handle.wait()
    return out


def _row_backward(coc, ctx, dy):
    x, weight = ctx.saved
    group, sequence_parallel, chunks, accumulate = ctx.opts
    if not sequence_parallel:       # dY is the same on every rank: nothing to communicate
        return dy.matmul(weight), _wgrad(coc.kernels, weight, x, dy, accumulate), None, None, None, None
    comm = coc.comm
    n, rows = comm.world_size(group), dy.shape[0]
    pieces = bounds(rows, chunks)
    pending = [comm.all_gather_async(dy[a:b], 0, group) for a, b in pieces]
    dx = x.new_zeros(tuple(x.shape))
    dy_full = dy.new_zeros((n * rows,) + tuple(dy.shape[1:]))
    for (a, b), handle in zip(pieces, pending):
        part = handle.wait()
        put_interleaved(dy_full, part, n, rows, a, b)
        put_interleaved(dx, part.matmul(weight), n, rows, a, b)
    return dx, _wgrad(coc.kernels, weight, x, dy_full, accumulate), None, None, None, None


class Coc:
    """The CoC linears over one backend: its collectives and kernels, and the two custom ops (made once)."""

    def __init__(self, backend):
        self.comm, self.kernels = backend.comm, backend.kernels
        op, bound = backend.autograd.custom_op, lambda fn: functools.update_wrapper(functools.partial(fn, self), fn)
        self._column = op(bound(_column_forward), bound(_column_backward))
        self._row = op(bound(_row_forward), bound(_row_backward))

    def column_linear(self, x, weight, group, *, sequence_parallel: bool, chunks: int, accumulate: bool = False):
        """Y = X W^T of a column-parallel layer (X gathered first under sequence parallelism); backward
        reduces dX over `group` (all-reduce, or reduce-scatter under sequence parallelism)."""
        return self._column(x, weight, group, sequence_parallel, chunks, accumulate)

    def row_linear(self, x, weight, group, *, sequence_parallel: bool, chunks: int, accumulate: bool = False):
        """sum over `group` of X W^T of a row-parallel layer (all-reduce, or reduce-scatter along the
        first dim under sequence parallelism); backward gathers dY under sequence parallelism."""
        return self._row(x, weight, group, sequence_parallel, chunks, accumulate)
