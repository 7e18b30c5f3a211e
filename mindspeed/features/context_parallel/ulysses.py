"""Ulysses: swap sequence and heads with all_to_all around the attention kernel.

[s/P, b, n*d] --all_to_all--> [s, b, (n/P)*d], attention on the whole sequence with n/P heads,
--all_to_all--> [s/P, b, n*d]. The differentiable all_to_all's backward is the reverse swap.
GQA: key/value heads are repeated (in place, keeping the query->kv head mapping) until they
divide by P.
"""
from __future__ import annotations

import math

from mindspeed.features import documents as packed_documents
from mindspeed.features.context_parallel.tensor_ops import repeat_heads


def kv_repeats(head_num: int, kv_heads: int, size: int) -> int:
    """How often each kv head is repeated so that kv heads divide by `size` (1 if they do)."""
    if head_num % size:
        raise ValueError(f"Ulysses context parallelism: {head_num} attention heads (per tensor-parallel "
                         f"rank) do not divide by the Ulysses degree {size}")
    if head_num % kv_heads:
        raise ValueError(f"{head_num} query heads are not a multiple of {kv_heads} key/value heads")
    repeats = size // math.gcd(kv_heads, size)
    if (head_num // kv_heads) % repeats:
        raise ValueError(f"Ulysses context parallelism: {kv_heads} key/value heads cannot be repeated to a "
                         f"multiple of the Ulysses degree {size} within {head_num} query heads")
    return repeats


def ulysses_attention(q, k, v, *, backend, head_num: int, group=None, attend=None, causal: bool = True,
                      mask=None, scale: float | None = None, dropout_p: float = 0.0, documents=None):
    """q [s/P, b, n*d], k/v [s/P, b, nkv*d] (SBH, this rank's contiguous part of the sequence) ->
    [s/P, b, n*d]. attend(q, k, v, head_num) runs on the gathered sequence (default: the attention
    kernel with `causal`/`mask`, or causal inside each document when `documents` gives the
    samples' cumulative document ends over the whole sequence; hybrid passes ring attention). The
    collectives and kernels are `backend`'s (the run's)."""
    comm = backend.comm
    size = comm.world_size(group)
    head_dim = q.shape[-1] // head_num
    repeats = kv_repeats(head_num, k.shape[-1] // head_dim, size)
    k, v = repeat_heads(k, head_dim, repeats), repeat_heads(v, head_dim, repeats)
    if attend is None and documents is not None:
        def attend(q_, k_, v_, heads):
            return packed_documents.attention(q_, k_, v_, documents, kernels=backend.kernels, head_num=heads,
                                              scale=scale, causal=True, dropout_p=dropout_p)[0]
    elif attend is None:
        def attend(q_, k_, v_, heads):
            return backend.kernels.attention(q_, k_, v_, layout="SBH", head_num=heads, scale=scale,
                                             causal=causal and mask is None, mask=mask,
                                             dropout_p=dropout_p)[0]
    if size == 1:
        return attend(q, k, v, head_num)
    q, k, v = (comm.all_to_all_autograd(t, 2, 0, group) for t in (q, k, v))
    out = attend(q, k, v, head_num // size)
    return comm.all_to_all_autograd(out, 0, 2, group)
