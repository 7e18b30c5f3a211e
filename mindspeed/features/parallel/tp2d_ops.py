"""2-D tensor parallelism's algorithm (feature 'tp-2d'), written against the backend interface.

The TP ranks form an x-by-y grid (tp = x * y); TP rank r sits at (x_rank, y_rank) = (r % x, r // x).
Between layers a rank holds sequence chunk x_rank (of x) and hidden chunk y_rank (of y): [s/x, b, h/y].

A 2-D linear Y = X W^T holds the rows chunk of W its `ag` group's rank names and the columns chunk
its `rs` group's rank names, and communicates over both groups:

  forward   X_all = all_gather(X, dim 0, ag)                     [s, b, in/|rs|]
            Y = reduce_scatter(X_all W^T, dim 0, rs)             [s/|rs|, b, out/|ag|]
  backward  dY_all = all_gather(dY, dim 0, rs)
            dX = reduce_scatter(dY_all W, dim 0, ag)             [s/|ag|, b, in/|rs|]
            dW = dY_all^T all_gather(X, dim 0, ag)               (X gathered again: forward keeps X only)

The column layers (QKV, fc1) gather over x and reduce-scatter over y: [s/x, b, h/y] -> [s/y, b, out/x];
the row layers (proj, fc2) the other way round: [s/y, b, in/x] -> [s/x, b, h/y]. Between the two,
attention all-to-alls over y (sequence gathered, heads scattered: Ulysses over the y axis), and the
norms reduce their per-row sums over y instead of gathering the hidden size.

Small parameters (norm weights, biases) stay whole and replicated on every TP rank; a rank uses its
chunk, and the chunk's gradient is all-reduced over TP (each rank holds a different part of it), so
every rank holds the whole gradient, as for any replicated parameter.
"""
from __future__ import annotations

import functools


def grid_groups(tp_groups: list[list[int]], x: int, y: int) -> list[tuple[list[int], list[int]]]:
    """For each TP group (its global ranks in TP-rank order), each (x group, y group) pair's ranks, in
    the order every rank creates them: x groups (same y_rank) first, then y groups (same x_rank)."""
    out = []
    for ranks in tp_groups:
        if len(ranks) != x * y:
            raise ValueError(f"a TP group of {len(ranks)} ranks is no {x} x {y} grid")
        xs = [[ranks[j * x + i] for i in range(x)] for j in range(y)]
        ys = [[ranks[j * x + i] for j in range(y)] for i in range(x)]
        out.append((xs, ys))
    return out


def _chunk(t, dim: int, index: int, parts: int):
    size = t.shape[dim] // parts
    return t.narrow(dim, index * size, size)


class Grid:
    """One rank's place in the x-by-y grid, its groups, and the 2-D ops over one backend."""

    def __init__(self, backend, x: int, y: int, tp_group, x_group, y_group):
        self.comm, self.x, self.y = backend.comm, x, y
        self.tp_group, self.x_group, self.y_group = tp_group, x_group, y_group
        self.x_rank, self.y_rank = self.comm.rank(x_group), self.comm.rank(y_group)
        op = backend.autograd.custom_op
        bound = lambda fn: functools.update_wrapper(functools.partial(fn, self), fn)   # noqa: E731
        self._linear = op(bound(_linear_forward), bound(_linear_backward))
        self._sum_y = op(bound(_sum_y_forward), bound(_sum_y_backward))
        self._piece = op(bound(_piece_forward), bound(_piece_backward))
        self._scatter = op(bound(_scatter_forward), bound(_gather_forward))
        self._gather = op(bound(_gather_forward), bound(_scatter_forward))

    @classmethod
    def build(cls, backend, x: int, y: int, tp_groups: list[list[int]], tp_group):
        """Every rank creates every grid group (the backend's new_group is collective), keeping its own."""
        me = backend.comm.rank()
        mine_x = mine_y = None
        for xs, ys in grid_groups(tp_groups, x, y):
            for ranks in xs:
                group = backend.comm.new_group(ranks)
                mine_x = group if me in ranks else mine_x
            for ranks in ys:
                group = backend.comm.new_group(ranks)
                mine_y = group if me in ranks else mine_y
        return cls(backend, x, y, tp_group, mine_x, mine_y)

    def size(self, group) -> int:
        return self.x if group is self.x_group else self.y

    def group_rank(self, group) -> int:
        return self.x_rank if group is self.x_group else self.y_rank

    # -- the ops ---------------------------------------------------------------------------------
    def linear(self, x, weight, ag, rs):
        """Y = X W^T of a 2-D linear: gathered over `ag`, reduced and scattered over `rs`."""
        return self._linear(x, weight, ag, rs)

    def piece(self, full, index: int, parts: int):
        """Chunk `index` of `parts` of a replicated parameter's dim 0; backward: its gradient, zero
        elsewhere, summed over TP (every rank then holds the whole gradient)."""
        return self._piece(full, index, parts)

    def sum_over_y(self, t):
        """The sum of `t` over the y group (per-row partial sums of the hidden size), differentiable."""
        return self._sum_y(t)

    def scatter(self, hidden):
        """[s, b, h], the same on every TP rank -> this rank's [s/x, b, h/y]; backward gathers."""
        return self._scatter(hidden)

    def gather(self, hidden):
        """This rank's [s/x, b, h/y] -> [s, b, h] on every TP rank; backward keeps this rank's chunk."""
        return self._gather(hidden)

    def heads_to_sequence(self, t):
        """[s/y, b, heads, d] -> [s, b, heads/y, d]: attention sees the whole sequence (Ulysses over y)."""
        return self.comm.all_to_all_autograd(t, 2, 0, self.y_group) if self.y > 1 else t

    def sequence_to_heads(self, t):
        """[s, b, heads/y * d] -> [s/y, b, heads * d], the inverse of heads_to_sequence."""
        return self.comm.all_to_all_autograd(t, 0, 2, self.y_group) if self.y > 1 else t

    def norm(self, x, weight, bias, eps: float, rms: bool, hidden: int):
        """LayerNorm / RMSNorm of [s/x, b, h/y] over the whole hidden size `hidden`."""
        w = self.piece(weight, self.y_rank, self.y)
        if rms:
            mean_square = self.sum_over_y((x * x).sum(-1, keepdim=True)) / hidden
            return x * (mean_square + eps).rsqrt() * w
        centred = x - self.sum_over_y(x.sum(-1, keepdim=True)) / hidden
        var = self.sum_over_y((centred * centred).sum(-1, keepdim=True)) / hidden
        out = centred * (var + eps).rsqrt() * w
        return out if bias is None else out + self.piece(bias, self.y_rank, self.y)


def _gemm(x, weight):
    return x.matmul(weight.transpose(1, 0))


def _linear_forward(grid, ctx, x, weight, ag, rs):
    ctx.save(x, weight)
    ctx.opts = (ag, rs)
    comm = grid.comm
    return comm.reduce_scatter(_gemm(comm.all_gather(x, 0, ag), weight), 0, rs)


def _linear_backward(grid, ctx, dy):
    x, weight = ctx.saved
    ag, rs = ctx.opts
    comm = grid.comm
    dy_all = comm.all_gather(dy, 0, rs)
    dx = comm.reduce_scatter(dy_all.matmul(weight), 0, ag)
    x_all = comm.all_gather(x, 0, ag)
    dy2, x2 = dy_all.reshape(-1, dy_all.shape[-1]), x_all.reshape(-1, x_all.shape[-1])
    return dx, dy2.transpose(1, 0).matmul(x2), None, None


def _sum_y_forward(grid, ctx, t):
    return grid.comm.all_reduce(t.contiguous(), "sum", grid.y_group) if grid.y > 1 else t * 1


def _sum_y_backward(grid, ctx, dt):
    # every y rank used the sum: the gradient of each rank's part is the sum of theirs
    return _sum_y_forward(grid, ctx, dt)


def _piece_forward(grid, ctx, full, index, parts):
    ctx.opts = (tuple(full.shape), index, parts)
    return _chunk(full, 0, index, parts).contiguous()


def _piece_backward(grid, ctx, dpiece):
    shape, index, parts = ctx.opts
    dfull = dpiece.new_zeros(shape)
    size = shape[0] // parts
    dfull[index * size:(index + 1) * size] = dpiece
    return grid.comm.all_reduce(dfull, "sum", grid.tp_group), None, None


def _scatter_forward(grid, ctx, hidden):
    return _chunk(_chunk(hidden, 0, grid.x_rank, grid.x), -1, grid.y_rank, grid.y).contiguous()


def _gather_forward(grid, ctx, part):
    return grid.comm.all_gather(grid.comm.all_gather(part, -1, grid.y_group), 0, grid.x_group)
