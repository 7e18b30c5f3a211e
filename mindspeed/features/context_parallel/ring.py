"""Ring attention (Megatron-style, load balanced) written against the backend interface.

The group's sequence is cut into 2N chunks of c tokens; ring rank r holds chunks r and 2N-1-r as
one local sequence of 2c tokens, so every rank does the same causal work. K/V blocks travel
round the ring with comm.send_recv; each block's partial attention (kernels.attention, which
returns the softmax max and sum) is merged with ring_attention_update (the reference, or the fused kernel under
--use-fused-ring-attention-update), in fp32.

Causal blocks from the rank that owns K/V (`owner`):
  owner == r: the local causal triangle;
  owner <  r: every local query sees the owner's first chunk only (its second chunk is later);
  owner >  r: only the second local chunk sees anything, and it sees the owner's whole block.
A general mask (True = masked out, over global positions) is sliced per block instead.

Backward: the rotation is a custom_op whose backward sends the K/V gradient back the way the
block came, so autograd differentiates the whole ring (attention and merge are differentiable).
Double ring (window w > 1): blocks circle inside windows of w ranks, then hop to the next window.
"""
from __future__ import annotations

from mindspeed.features.context_parallel import ring_documents


def ring_schedule(rank: int, size: int, window: int = 1) -> list[tuple[int, tuple[int, int] | None]]:
    """For each step: (ring rank whose K/V this rank holds, (dst, src) of the rotation after the
    step, or None after the last). Ranks r = a*window + p: inner rotations go p -> p+1 inside
    window a, after every window-th step an outer one goes a -> a+1. Simulated, not derived, so
    every block visits every rank exactly once by construction (checked)."""
    if window < 1 or size % window:
        raise ValueError(f"cp window size {window} must be >= 1 and divide the ring size {size}")
    holds = list(range(size))                  # holds[rank] = owner of the block there now
    steps = []
    for step in range(size):
        if step == size - 1:
            steps.append((holds[rank], None))
            break
        inner = (step + 1) % window != 0
        def dst_of(q):
            a, p = divmod(q, window)
            return a * window + (p + 1) % window if inner else ((a + 1) % (size // window)) * window + p
        src = next(q for q in range(size) if dst_of(q) == rank)
        steps.append((holds[rank], (dst_of(rank), src)))
        moved = [None] * size
        for q in range(size):
            moved[dst_of(q)] = holds[q]
        holds = moved
    if sorted(o for o, _ in steps) != list(range(size)):
        raise AssertionError(f"ring schedule for rank {rank} does not visit every block: {steps}")
    return steps


def chunk_positions(rank: int, size: int, chunk: int) -> list[int]:
    """Positions in the group's sequence of ring rank `rank`'s local tokens (chunks r, 2N-1-r)."""
    return (list(range(rank * chunk, (rank + 1) * chunk))
            + list(range((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)))


class _Rotation:
    """One K/V hop as a differentiable op: forward sends to dst and receives from src; backward
    returns the received blocks' gradients to src and takes the sent blocks' from dst."""

    def __init__(self, dst: int, src: int, group, backend):
        self.dst, self.src, self.group, self.handles = dst, src, group, []
        self.comm = backend.comm
        self.op = backend.autograd.custom_op(self._forward, self._backward)

    def start(self, k, v):
        return self.op(k, v)

    def wait(self):
        for h in self.handles:
            h.wait()
        self.handles = []

    def _forward(self, ctx, k, v):
        # contiguous: torch's send_recv receives into empty_like(send), which keeps strides
        k_in, hk = self.comm.send_recv(k.contiguous(), self.dst, self.src, self.group)
        v_in, hv = self.comm.send_recv(v.contiguous(), self.dst, self.src, self.group)
        self.handles = [hk, hv]
        return k_in, v_in

    def _backward(self, ctx, grad_k, grad_v):
        gk, hk = self.comm.send_recv(grad_k.contiguous(), self.src, self.dst, self.group)
        gv, hv = self.comm.send_recv(grad_v.contiguous(), self.src, self.dst, self.group)
        hk.wait()
        hv.wait()
        return gk, gv


def merge_kernel(kernels, fused_merge: bool):
    """The ring_attention_update that merges partial results: the backend's fused one under
    --use-fused-ring-attention-update (fused_merge), else its reference."""
    return kernels.ring_attention_update if fused_merge else kernels.reference.ring_attention_update


def merge_partial(merge, acc, out, mx, sm):
    """acc (out, max, sum in fp32, or None before the first block) merged with a block's partial result."""
    if acc is None:
        return out.float(), mx, sm
    return merge(acc[0], acc[1], acc[2], out.float(), mx, sm)


def _halves(out, mx, sm, c):
    return (out[:c], mx[:, :, :c], sm[:, :, :c]), (out[c:], mx[:, :, c:], sm[:, :, c:])


def _owner_halves(kernels, q, k, v, kw, *, rank, owner, size, causal, mask, rows):
    """This rank's queries against `owner`'s keys/values: the partial (out, max, sum) of its first and
    of its second chunk; None for the first where the causal mask hides the whole block."""
    c = q.shape[0] // 2
    if mask is not None:
        block = mask[..., rows, :][..., chunk_positions(owner, size, c)]
        return _halves(*kernels.attention(q, k, v, mask=block, **kw), c)
    if not causal:
        return _halves(*kernels.attention(q, k, v, **kw), c)
    if owner == rank:
        return _halves(*kernels.attention(q, k, v, causal=True, **kw), c)
    if owner < rank:
        return _halves(*kernels.attention(q, k[:c], v[:c], **kw), c)
    return None, kernels.attention(q[c:], k, v, **kw)


def ring_attention(q, k, v, *, backend, head_num: int, group=None, causal: bool = True, mask=None,
                   scale: float | None = None, window_size: int = 1, overlap: bool = False,
                   dropout_p: float = 0.0, documents=None, fused_merge: bool = False):
    """q [2c, b, n*d], k/v [2c, b, nkv*d] (SBH; this ring rank's chunks r and 2N-1-r) ->
    attention output [2c, b, n*d] over the group's whole sequence. mask: None, or bool
    broadcastable to [b, n, S, S] over the group's sequence of S = 2Nc tokens (used instead of
    `causal`). documents: per sample, the cumulative ends of its packed documents over the S
    tokens: causal attention inside each document (ring_documents), instead of `causal`/`mask`.
    fused_merge: the steps merged by the backend's fused ring_attention_update, else its reference.
    backend: the run's (its collectives, kernels and autograd)."""
    comm, kernels = backend.comm, backend.kernels
    size, rank = comm.world_size(group), comm.rank(group)
    kw = dict(layout="SBH", head_num=head_num, scale=scale, dropout_p=dropout_p)
    if documents is not None and mask is not None:
        raise ValueError("ring attention: give documents or a mask, not both")
    if size == 1:
        if documents is not None:
            return ring_documents.diagonal(backend, q, k, v, documents, 0, q.shape[0], head_num=head_num,
                                           scale=scale, dropout_p=dropout_p)[0]
        return kernels.attention(q, k, v, causal=causal and mask is None, mask=mask, **kw)[0]
    if q.shape[0] % 2 or k.shape[0] != q.shape[0]:
        raise ValueError(f"ring attention: local q ({q.shape[0]} tokens) and k/v ({k.shape[0]}) must be "
                         "the same even length (two load-balanced chunks)")
    c = q.shape[0] // 2
    if mask is not None and mask.shape[-1] != 2 * size * c:
        raise ValueError(f"ring attention: mask covers {mask.shape[-1]} tokens, the ring's sequence "
                         f"has {2 * size * c}")
    rows = chunk_positions(rank, size, c) if mask is not None else None
    merge = merge_kernel(kernels, fused_merge)
    first = second = None
    for owner, rotation in ring_schedule(rank, size, window_size):
        hop = _Rotation(rotation[0], rotation[1], group, backend) if rotation else None
        incoming = hop.start(k, v) if hop and overlap else None   # transfer while computing
        if documents is not None:
            firsts, seconds = ring_documents.blocks(backend, q, k, v, documents, rank, owner, size, c,
                                                    head_num=head_num, scale=scale, dropout_p=dropout_p)
            for part in firsts:
                first = merge_partial(merge, first, *part)
            for part in seconds:
                second = merge_partial(merge, second, *part)
        else:
            a, b = _owner_halves(kernels, q, k, v, kw, rank=rank, owner=owner, size=size, causal=causal,
                                 mask=mask, rows=rows)
            if a is not None:
                first = merge_partial(merge, first, *a)
            second = merge_partial(merge, second, *b)
        if hop:
            if incoming is None:
                incoming = hop.start(k, v)
            hop.wait()
            k, v = incoming
    return backend.tensors.cat([first[0], second[0]], 0).to(q.dtype)
