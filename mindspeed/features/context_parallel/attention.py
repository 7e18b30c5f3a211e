"""One entry point for every CP algorithm (what the host-model hooks call)."""
from __future__ import annotations

from mindspeed.features.context_parallel.groups import CPGroups
from mindspeed.features.context_parallel.hybrid import hybrid_attention
from mindspeed.features.context_parallel.kvallgather import kvallgather_attention
from mindspeed.features.context_parallel.ring import ring_attention
from mindspeed.features.context_parallel.ulysses import ulysses_attention


def context_parallel_attention(q, k, v, cp: CPGroups, *, head_num: int, causal: bool = True, mask=None,
                               scale: float | None = None, dropout_p: float = 0.0, documents=None):
    """q [s_local, b, n*d], k/v [s_local, b, nkv*d] (SBH) sharded as sharding.local_positions
    says for cp.algo -> attention output [s_local, b, n*d]. mask: None or a bool mask over the
    whole sequence (True = masked out), broadcastable to [b, n, S, S]; it replaces `causal`.
    documents: None, or per sample the cumulative ends of its packed documents over the whole
    sequence (EOD reset): causal attention inside each document, no mask built. The collectives and
    kernels are cp.backend's."""
    common = dict(head_num=head_num, causal=causal, mask=mask, scale=scale, dropout_p=dropout_p,
                  documents=documents, backend=cp.backend)
    if cp.algo == "ulysses_cp_algo":
        return ulysses_attention(q, k, v, group=cp.ulysses_group, **common)
    if cp.algo == "kvallgather_cp_algo":
        return kvallgather_attention(q, k, v, group=cp.group, fused_merge=cp.fused_merge, **common)
    ring = dict(window_size=cp.window_size, overlap=cp.overlap, fused_merge=cp.fused_merge)
    if cp.algo == "megatron_cp_algo" or cp.ulysses_degree == 1:
        return ring_attention(q, k, v, group=cp.ring_group, **ring, **common)
    if cp.ring_size == 1:
        return ulysses_attention(q, k, v, group=cp.ulysses_group, **common)
    return hybrid_attention(q, k, v, ulysses_group=cp.ulysses_group, ring_group=cp.ring_group, **ring, **common)
