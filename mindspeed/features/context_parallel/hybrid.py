"""Hybrid CP (--ulysses-degree-in-cp u): Ulysses inside groups of u ranks gathers each ring rank's
two load-balanced chunks with n/u heads; ring attention runs across the P/u ring ranks."""
from __future__ import annotations

from mindspeed.features.context_parallel.ring import ring_attention
from mindspeed.features.context_parallel.ulysses import ulysses_attention


def hybrid_attention(q, k, v, *, backend, head_num: int, ulysses_group, ring_group, causal: bool = True,
                     mask=None, scale: float | None = None, window_size: int = 1, overlap: bool = False,
                     dropout_p: float = 0.0, documents=None, fused_merge: bool = False):
    def ring(q_, k_, v_, heads):
        return ring_attention(q_, k_, v_, backend=backend, head_num=heads, group=ring_group, causal=causal,
                              mask=mask, scale=scale, window_size=window_size, overlap=overlap, dropout_p=dropout_p,
                              documents=documents, fused_merge=fused_merge)

    return ulysses_attention(q, k, v, backend=backend, head_num=head_num, group=ulysses_group, attend=ring)
