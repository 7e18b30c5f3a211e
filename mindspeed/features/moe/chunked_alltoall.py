"""The all-to-alls of --moe-alltoall-overlap-comm's chunk pipeline as autograd nodes whose backward
overlaps too: a chunk's expert backward runs while other chunks' gradient all-to-alls travel.

Each all-to-all is cut into two nodes joined by an empty "link" tensor: the node nearer the loss
STARTS the reverse all-to-all in backward (comm.all_to_all_v_async) and the other WAITS for it
and passes the received gradient on; autograd runs other chunks' expert backward in between.

Forward (chunks c = 0..C-1), in alltoall_overlap._pipeline:
    links = dispatch(xs, probs)       DispatchJoin: starts every chunk's dispatch; one link per chunk
    for c: xt, pt = arrive(c, links[c], combines[c-1])    DispatchArrive: waits chunk c's dispatch
           y = experts(xt, pt)
           combines[c] = send_combine(c, y)           CombineSend: starts chunk c's combine; a link
    outs = combined(combines)         CombineJoin: waits every combine

Backward, and why every rank starts the gradient all-to-alls in the same order (they share the EP
group; a different order on two ranks pairs wrong messages or deadlocks): each start below is
forced after the previous one by a data edge, so the order does not depend on how autograd
schedules nodes that are ready together, only on the graph, which is the same on every rank:
    CombineJoin          starts chunk 0's, 1's, ... reverse combine (one node, a loop)
    CombineSend C-1      waits for its own; chunk C-1's experts backward run (the others in flight)
    DispatchArrive C-1   after those experts (its inputs' gradients): starts the reverse dispatch,
                         tokens then probs
    CombineSend C-2      after DispatchArrive C-1 (combines[C-2] is an input of arrive C-1): waits;
                         chunk C-2's experts backward run while dispatch C-1's gradients travel
    ...                  down to chunk 0
    DispatchJoin         needs every chunk's link: waits for every reverse dispatch, chunk 0 first,
                         and hands the gradients to the chunks' tokens and probs
"""
from __future__ import annotations

import torch

from mindspeed.features.moe.async_comm import (computing_backward, started, started_backward, waited,
                                               waited_backward)


def _link(like):
    return like.new_empty(0)         # carries an autograd edge, no data


class ChunkedAllToAll:
    """One layer call's chunk all-to-alls over `group`. splits[c] = (in_splits, out_splits): rows
    chunk c's dispatch sends to / receives from each rank (the combine is the reverse)."""

    def __init__(self, comm, group, splits):
        self.comm, self.group, self.splits = comm, group, splits
        chunks = len(splits)
        self.dispatched = [None] * chunks        # forward handles: (tokens, probs)
        self.combining = [None] * chunks
        self.grad_dispatch = [None] * chunks     # backward handles: (tokens or None, probs or None)
        self.grad_combine = [None] * chunks
        self.needs = (False, False)              # do the tokens / probs take gradients

    def a2a(self, x, output_splits, input_splits):
        return self.comm.all_to_all_v_async(x.contiguous(), output_splits, input_splits, self.group)

    def dispatch(self, xs, probs):
        self.needs = (torch.is_grad_enabled() and xs[0].requires_grad,
                      torch.is_grad_enabled() and probs[0].requires_grad)
        return _DispatchJoin.apply(self, *xs, *probs)

    def arrive(self, c, link, previous_combine=None):
        return _DispatchArrive.apply(self, c, link, previous_combine)

    def send_combine(self, c, y):
        return _CombineSend.apply(self, c, _ExpertsBackwardMark.apply(y))

    def combined(self, combines):
        return _CombineJoin.apply(self, *combines)


class _DispatchJoin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st, *xs_probs):
        ctx.st = st
        chunks = len(st.splits)
        for c in range(chunks):                  # in chunk order on every rank
            ins, outs = st.splits[c]
            st.dispatched[c] = (started(st.a2a(xs_probs[c], outs, ins)),
                                started(st.a2a(xs_probs[chunks + c], outs, ins)))
        return tuple(_link(xs_probs[0]) for _ in range(chunks))

    @staticmethod
    def backward(ctx, *_links):
        st = ctx.st
        grads = [[waited_backward(h) if h is not None else None for h in st.grad_dispatch[c]]
                 for c in range(len(st.splits))]
        st.grad_dispatch = [None] * len(st.splits)
        return (None, *(g[0] for g in grads), *(g[1] for g in grads))


class _DispatchArrive(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st, c, link, previous_combine):
        ctx.st, ctx.c = st, c
        tokens, probs = st.dispatched[c]
        st.dispatched[c] = None
        return waited(tokens), waited(probs)

    @staticmethod
    def backward(ctx, grad_tokens, grad_probs):
        st, c = ctx.st, ctx.c
        ins, outs = st.splits[c]
        need_tokens, need_probs = st.needs
        st.grad_dispatch[c] = (
            started_backward(st.a2a(grad_tokens, ins, outs), f"dispatch {c} tokens") if need_tokens else None,
            started_backward(st.a2a(grad_probs, ins, outs), f"dispatch {c} probs") if need_probs else None)
        link, previous = (grad_tokens.new_empty(0) if ctx.needs_input_grad[i] else None for i in (2, 3))
        return None, None, link, previous


class _ExpertsBackwardMark(torch.autograd.Function):
    """Identity on a chunk's expert output (back in source-rank order): its backward runs right before
    that chunk's expert backward, so it counts whether a gradient all-to-all is in flight then."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        computing_backward()
        return grad


class _CombineSend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st, c, y):
        ctx.st, ctx.c = st, c
        ins, outs = st.splits[c]
        st.combining[c] = started(st.a2a(y, ins, outs))
        return _link(y)

    @staticmethod
    def backward(ctx, _link_grad):
        st, c = ctx.st, ctx.c
        grad, st.grad_combine[c] = waited_backward(st.grad_combine[c]), None
        return None, None, grad


class _CombineJoin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st, *combines):
        ctx.st = st
        outs = []
        for c in range(len(st.splits)):
            outs.append(waited(st.combining[c]))
            st.combining[c] = None
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        st = ctx.st
        for c, grad in enumerate(grads):         # chunk order, in one node: the same on every rank
            ins, outs = st.splits[c]
            st.grad_combine[c] = started_backward(st.a2a(grad, outs, ins), f"combine {c}")
        return (None, *(grad.new_empty(0) for grad in grads))
