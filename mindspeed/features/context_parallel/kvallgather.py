"""KV all-gather context parallelism (the Llama 3 paper's CP), written against the backend interface.

Every CP rank keeps its own queries: Megatron's load-balanced layout, 2P chunks of c tokens, rank r
holding chunks r and 2P-1-r. K and V are all-gathered over the CP group (comm.all_gather_autograd,
whose backward is the reduce-scatter of dK/dV) and put back in sequence order; each local query
chunk g then attends to the keys it may see:
  causal: keys [0, (g+1)c) with the mask's diagonal shifted by g*c (the band next_tokens = g*c:
    query i of the chunk, at position g*c + i, sees keys j <= g*c + i);
  a general mask (True = masked out, over global positions): its rows of the chunk, every key;
  packed documents (EOD reset): the chunk's own keys causal inside each document, merged with the
    earlier keys that the document holding the chunk's first token reaches back to
    (ring_documents.reach_back);
  neither: every key.
The document parts merge as the ring's steps do (ring.merge_partial; the fused ring_attention_update
under --use-fused-ring-attention-update). No ring steps, so nothing overlaps the all-gather; what it buys is one collective per layer and
GQA-sized K/V on the wire.
"""
from __future__ import annotations

from mindspeed.features.context_parallel import ring_documents
from mindspeed.features.context_parallel.ring import chunk_positions, merge_kernel, merge_partial


def gather_sequence(backend, t, group, size: int):
    """This rank's [2c, b, h] (chunks r and 2P-1-r) -> [2Pc, b, h], the group's sequence in order.
    Differentiable: the gradient of each rank's chunks is summed back to it (reduce-scatter)."""
    every = backend.comm.all_gather_autograd(t.contiguous(), 0, group)     # rank order: [r's 2c tokens] * P
    c = t.shape[0] // 2
    # slot 2r + half of `every` holds chunk chunk_positions(r, size, 1)[half] of the sequence
    slot_of = {chunk: 2 * r + half for r in range(size) for half, chunk in enumerate(chunk_positions(r, size, 1))}
    return backend.tensors.cat([every[slot_of[g] * c:(slot_of[g] + 1) * c] for g in range(2 * size)], 0)


def _documents_chunk(backend, q, k, v, ends, g: int, c: int, merge, **kw):
    """Chunk g's queries against the sequence's keys k/v, causal inside each packed document."""
    keys = slice(g * c, (g + 1) * c)
    own = merge_partial(merge, None, *ring_documents.diagonal(backend, q, k[keys], v[keys], ends, g, c, **kw))
    back = ring_documents.reach_back(backend, q, k[:g * c], v[:g * c], ends, g * c, 0, **kw) if g else None
    return (own if back is None else merge_partial(merge, own, *back))[0]


def _chunk(backend, q, k, v, g: int, c: int, *, causal: bool, mask, documents, merge, kw):
    """Chunk g's c queries against the sequence's whole k/v -> out [c, b, n*dv]."""
    if documents is not None:
        return _documents_chunk(backend, q, k, v, documents, g, c, merge, **kw)
    attention = backend.kernels.attention
    if mask is not None:
        return attention(q, k, v, mask=mask[..., g * c:(g + 1) * c, :], layout="SBH", **kw)[0]
    if not causal:
        return attention(q, k, v, layout="SBH", **kw)[0]
    end = (g + 1) * c
    return attention(q, k[:end], v[:end], next_tokens=g * c, layout="SBH", **kw)[0]


def kvallgather_attention(q, k, v, *, backend, head_num: int, group=None, causal: bool = True, mask=None,
                          scale: float | None = None, dropout_p: float = 0.0, documents=None,
                          fused_merge: bool = False):
    """q [2c, b, n*d], k/v [2c, b, nkv*d] (SBH; this rank's chunks r and 2P-1-r) -> attention output
    [2c, b, n*d] over the group's whole sequence of S = 2Pc tokens. mask: None, or bool broadcastable
    to [b, n, S, S] (used instead of `causal`). documents: per sample, the cumulative ends of its
    packed documents over the S tokens (causal inside each, instead of `causal`/`mask`). fused_merge: the
    document parts merged by the backend's fused ring_attention_update, else its reference. backend: the
    run's (its collectives and kernels)."""
    if documents is not None and mask is not None:
        raise ValueError("kv all-gather attention: give documents or a mask, not both")
    if q.shape[0] % 2 or k.shape[0] != q.shape[0]:
        raise ValueError(f"kv all-gather attention: local q ({q.shape[0]} tokens) and k/v ({k.shape[0]}) "
                         "must be the same even length (two load-balanced chunks)")
    comm = backend.comm
    size, rank = comm.world_size(group), comm.rank(group)
    c = q.shape[0] // 2
    if mask is not None and mask.shape[-1] != 2 * size * c:
        raise ValueError(f"kv all-gather attention: mask covers {mask.shape[-1]} tokens, the CP group's "
                         f"sequence has {2 * size * c}")
    k, v = gather_sequence(backend, k, group, size), gather_sequence(backend, v, group, size)
    kw = dict(head_num=head_num, scale=scale, dropout_p=dropout_p)
    merge = merge_kernel(backend.kernels, fused_merge)
    outs = [_chunk(backend, q[h * c:(h + 1) * c], k, v, g, c, causal=causal, mask=mask, documents=documents,
                   merge=merge, kw=kw)
            for h, g in enumerate(chunk_positions(rank, size, 1))]
    return backend.tensors.cat(outs, 0).to(q.dtype)
