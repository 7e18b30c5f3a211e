"""The Megatron-Core hook of --moe-alltoall-overlap-comm: the alltoall dispatcher's dispatch,
expert compute and combine run as a pipeline of CHUNKS pieces.

Every expert's block of permuted rows is cut into CHUNKS near-equal parts; chunk c holds part c
of every expert's block. All chunks' dispatch all-to-alls are started at once (with the shared
experts' first GEMM, under --moe-shared-expert-overlap, run while the first is in flight); then for
each chunk: wait for its tokens, sort them by local expert, run the experts, unsort, and start its
combine all-to-all, which travels while the next chunk's experts compute. Finally every chunk's
combined rows are put back at the rows they came from, so the dispatcher's combine_postprocess
(unpermute) sees what Megatron's own path gives it.

Each token's expert output does not depend on the other tokens, so the pipeline computes the same
outputs; the experts' weight gradients are summed over chunks (the reduction order differs, within
fp32 rounding). Gradients of the all-to-alls are the reverse all-to-alls, overlapped in backward
too: every chunk's reverse combine starts at once, each chunk's expert backward waits only for its
own, and its reverse dispatch travels while the next chunk's expert backward runs; the order every
rank starts them in is fixed by the graph (chunked_alltoall.py).
"""
from __future__ import annotations

import functools

import torch

from mindspeed.features.moe.async_comm import computing
from mindspeed.features.moe.chunked_alltoall import ChunkedAllToAll
from mindspeed.features.moe import layer_pipeline
from mindspeed.features.moe.chunks import CHUNKS, piece
from mindspeed.features.moe.permutation_async import as_list

WHY = "--moe-alltoall-overlap-comm: alltoall dispatch/combine in chunks overlapped with the experts"


def chunk_plan(sent: list[int], received: list[list[int]], ep: int, chunks: int) -> list[dict]:
    """For each chunk: the rows of the permuted local tokens it takes (`rows`), its all-to-all
    splits, and the index that sorts the received rows by local expert (`by_expert`).

    sent[e]: rows this rank sends to global expert e (expert-major order, rank j owns experts
    j*L..j*L+L-1); received[s][k]: rows source rank s sends to this rank's local expert k."""
    local = len(received[0])
    offsets = [0]
    for n in sent:
        offsets.append(offsets[-1] + n)
    plans = []
    for c in range(chunks):
        rows, in_splits = [], [0] * ep
        for e, n in enumerate(sent):
            a, b = piece(n, c, chunks)
            rows.extend(range(offsets[e] + a, offsets[e] + b))
            in_splits[e // local] += b - a
        sizes = [[piece(received[s][k], c, chunks)[1] - piece(received[s][k], c, chunks)[0]
                  for k in range(local)] for s in range(ep)]
        starts, at = [[0] * local for _ in range(ep)], 0
        for s in range(ep):
            for k in range(local):
                starts[s][k], at = at, at + sizes[s][k]
        by_expert = [i for k in range(local) for s in range(ep)
                     for i in range(starts[s][k], starts[s][k] + sizes[s][k])]
        plans.append(dict(rows=rows, in_splits=in_splits, out_splits=[sum(r) for r in sizes],
                          by_expert=by_expert, per_expert=[sum(sizes[s][k] for s in range(ep)) for k in range(local)]))
    return plans


def _applies(layer) -> bool:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    d = layer.token_dispatcher
    return isinstance(d, MoEAlltoAllTokenDispatcher) and d.ep_size > 1 and d.tp_size == 1 and not d.drop_and_pad


def _pipeline(layer, tokens, probs, comm):
    d = layer.token_dispatcher
    d.tokens_per_expert = d._maybe_dtoh_and_synchronize("before_ep_alltoall", d.tokens_per_expert)
    local, ep = d.num_local_experts, d.ep_size
    sent = [int(n) for n in d.routing_map.sum(dim=0).tolist()]
    if local > 1:
        received = torch.as_tensor(d.num_global_tokens_per_local_expert).reshape(ep, local).tolist()
    else:
        received = [[n] for n in as_list(d.output_splits)]
    plans = chunk_plan(sent, received, ep, CHUNKS)
    device = tokens.device
    a2a = ChunkedAllToAll(comm, d.ep_group, [(p["in_splits"], p["out_splits"]) for p in plans])
    picks = [torch.tensor(p["rows"], dtype=torch.long, device=device) for p in plans]
    links = a2a.dispatch([tokens.index_select(0, r) for r in picks], [probs.index_select(0, r) for r in picks])
    if d.shared_experts is not None:         # --moe-shared-expert-overlap: its fc1 under the first all-to-all
        computing()
        d.shared_experts.linear_fc1_forward_and_act(None)
    combines = []                            # each chunk's combine link: the next chunk's arrival takes it
    for c, p in enumerate(plans):
        xt, pt = a2a.arrive(c, links[c], combines[-1] if combines else None)
        order = torch.tensor(p["by_expert"], dtype=torch.long, device=device)
        xt, pt = xt.index_select(0, order), pt.index_select(0, order)
        computing()                          # counted when another chunk's all-to-all is in flight
        y, bias = layer.experts(xt, torch.tensor(p["per_expert"], dtype=torch.long), pt)
        assert bias is None, "mlp_bias is not supported with --moe-alltoall-overlap-comm"
        combines.append(a2a.send_combine(c, y.index_select(0, torch.argsort(order))))   # in source-rank order
    d.tokens_per_expert = None
    return torch.cat(a2a.combined(combines)).index_select(0, torch.argsort(torch.cat(picks)))


def install(patcher, backend) -> None:
    """The MoE layer's hooks; the chunks' all-to-alls run on `backend`'s comm (the run's)."""
    layer_pipeline.install(patcher, _applies, functools.partial(_pipeline, comm=backend.comm), WHY,
                           pending="_overlap_pending")
