"""The Megatron-Core hook of --moe-allgather-overlap-comm: the allgather dispatcher's all-gather of
tokens and probabilities and its reduce-scatter of the outputs run per local expert, each one
overlapped with another expert's compute.

The routing map is gathered first (small, synchronous). Chunk k then holds, on every rank, the
local tokens routed to an expert of local index k on any rank (zero-padded to the longest rank's
count, as an all-gather needs); every chunk's gathers (tokens, probabilities) start at once. For
each k: wait for chunk k, run local expert k on exactly the rows Megatron's permute gives it (in
global token order), scatter its outputs into the chunk's rows and start their reduce-scatter,
which travels while expert k+1 computes. Each rank adds the chunks' reduce-scattered rows back at
its tokens.

Every expert sees the same input rows in the same order as on Megatron's path, so its outputs and
weight gradients are the same bits. A token's output (and its input gradient) is a sum over the
(rank, expert) pairs it is routed to, the other terms exact zeros: with top-k <= 2 that is a sum of
at most two numbers, which IEEE addition gives bitwise whatever the grouping; with a larger top-k the
grouping (per expert, then over ranks) differs within fp32 rounding. The backward collectives are
the adjoints (reduce-scatter, all-gather), synchronous (async_comm.finish).
"""
from __future__ import annotations

import functools

import torch

from mindspeed.features.moe import layer_pipeline
from mindspeed.features.moe.async_comm import computing, finish, started

WHY = "--moe-allgather-overlap-comm: allgather dispatch/combine per local expert, overlapped with the experts"


def _applies(layer) -> bool:
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
    d = layer.token_dispatcher
    return isinstance(d, MoEAllGatherTokenDispatcher) and d.tp_ep_group.size() > 1


def _padded(x, rows, length):
    """x's `rows`, then zero rows up to `length` (every rank's piece of an all-gather has one size)."""
    picked = x.index_select(0, rows)
    return torch.cat([picked, picked.new_zeros((length - len(rows),) + tuple(x.shape[1:]))])


def chunk_rows(routing_map, experts_by_chunk, ranks: int) -> list[list[torch.Tensor]]:
    """rows[k][r]: the local token indices of rank r routed to any expert of chunk k (ascending).
    routing_map: the gathered [ranks * tokens, experts] map, rank-major."""
    per_rank = routing_map.reshape(ranks, -1, routing_map.shape[-1])
    return [[torch.nonzero(per_rank[r][:, experts].any(dim=1)).flatten() for r in range(ranks)]
            for experts in experts_by_chunk]


def _pipeline(layer, hidden, probs, comm):
    d = layer.token_dispatcher
    group, local = d.tp_ep_group, d.num_local_experts
    ranks, me = group.size(), group.rank()
    routing_map = comm.all_gather(d.routing_map, 0, group)     # as Megatron's gather, without gradient
    d.routing_map = None
    # chunk k: the experts of local index k on every rank (rank j owns experts j*local .. j*local+local-1)
    experts_by_chunk = [list(range(k, routing_map.shape[-1], local)) for k in range(local)]
    rows = chunk_rows(routing_map, experts_by_chunk, ranks)
    lengths = [max(len(r) for r in chunk) for chunk in rows]
    tokens_handles = []
    for k in range(local):                   # in chunk order on every rank
        x, p = _padded(hidden, rows[k][me], lengths[k]), _padded(probs, rows[k][me], lengths[k])
        tokens_handles.append((x, started(comm.all_gather_async(x.detach(), 0, group)),
                               p, started(comm.all_gather_async(p.detach(), 0, group))))
    reduce = functools.partial(comm.reduce_scatter, dim=0, group=group)
    gather = functools.partial(comm.all_gather, dim=0, group=group)
    combining = []
    for k, (x, xh, p, ph) in enumerate(tokens_handles):
        gathered_x, gathered_p = finish(xh, x, reduce), finish(ph, p, reduce)
        expert = d.local_expert_indices[k]
        # the rows of the gathered chunk routed to this expert, in global token order (Megatron's permute)
        tokens = hidden.shape[0]
        pick = torch.cat([r * lengths[k] + torch.nonzero(routing_map[r * tokens + rows[k][r], expert]).flatten()
                          for r in range(ranks)])
        counts = torch.zeros(local, dtype=torch.long)
        counts[k] = len(pick)
        computing()                          # counted when another chunk's collective is in flight
        y, bias = layer.experts(gathered_x.index_select(0, pick), counts, gathered_p[pick, expert])
        assert bias is None, "mlp_bias is not supported with --moe-allgather-overlap-comm"
        out = y.new_zeros(gathered_x.shape).index_add(0, pick, y).to(probs.dtype)
        combining.append((out, started(comm.reduce_scatter_async(out.detach(), 0, group))))
    output = hidden.new_zeros(hidden.shape)
    for k, (out, handle) in enumerate(combining):
        mine = rows[k][me]
        output = output.index_add(0, mine, finish(handle, out, gather)[:len(mine)].to(hidden.dtype))
    return output


def install(patcher, backend) -> None:
    """The MoE layer's hooks; the chunks' collectives run on `backend`'s comm (the run's)."""
    layer_pipeline.install(patcher, _applies, functools.partial(_pipeline, comm=backend.comm), WHY,
                           pending="_allgather_overlap_pending")
