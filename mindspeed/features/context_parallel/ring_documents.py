"""Ring attention's blocks when the sequence holds packed documents (EOD reset), without a mask.

The sequence keeps its load-balanced chunks of c tokens; each (query chunk, key chunk) block
attends only inside documents:
  same chunk: every document's part of the chunk is causal on its own (one TND kernel call);
  earlier key chunk: only the document holding the query chunk's first token can reach back, so the
    block is one rectangle per sample: that document's rows of the query chunk against its keys in
    the key chunk (no mask); the other rows see nothing (max -inf, sum 0, which the merge skips);
  later key chunk: nothing.
reach_back is the earlier block for keys of any length before the queries (KV all-gather CP's
whole prefix in one call).
"""
from __future__ import annotations

from mindspeed.features import documents


def diagonal(backend, q, k, v, ends, chunk: int, c: int, **kw):
    """Chunk `chunk`'s queries against its own keys: (out [c, b, n*d], max, sum [b, n, c])."""
    return documents.attention(q, k, v, documents.within(ends, chunk * c, (chunk + 1) * c), kernels=backend.kernels,
                               causal=True, **kw)


def _blank_rows(cat, out, mx, sm, rows: int):
    """Keep the first `rows` query rows; the rest attend to nothing here (out 0, max -inf, sum 0)."""
    return (cat([out[:rows], out[rows:] * 0], 0), cat([mx[..., :rows], mx[..., rows:] - float("inf")], -1),
            cat([sm[..., :rows], sm[..., rows:] * 0], -1))


def earlier(backend, q, k, v, ends, q_chunk: int, k_chunk: int, c: int, **kw):
    """Chunk q_chunk's queries against the keys of an earlier chunk k_chunk, or None if no query
    of any sample shares a document with them."""
    if k_chunk >= q_chunk:
        raise ValueError(f"ring attention: key chunk {k_chunk} is not before query chunk {q_chunk}")
    return reach_back(backend, q, k, v, ends, q_chunk * c, k_chunk * c, **kw)


def reach_back(backend, q, k, v, ends, first: int, key_start: int, **kw):
    """Queries at positions [first, first + len(q)) against keys at [key_start, key_start + len(k)),
    all before `first`: per sample, the rows of the document holding `first` see that document's keys
    (no mask), the other rows nothing. None if no sample's rows see any key."""
    c, n_keys, cat = q.shape[0], k.shape[0], backend.tensors.cat
    key_end = key_start + n_keys
    if key_end > first:
        raise ValueError(f"documents: keys up to {key_end} are not before the queries from {first}")
    parts, reached = [], False
    for i, row in enumerate(ends):
        start = documents.document_start(row, first)
        rows = min(documents.document_end(row, first), first + c) - first
        if start >= key_end:          # that document begins after the keys: one key, all rows blank
            keys_from, rows = n_keys - 1, 0
        else:
            keys_from, reached = max(start - key_start, 0), True
        sample = slice(i, i + 1)
        part = backend.kernels.attention(q[:, sample], k[keys_from:, sample], v[keys_from:, sample], layout="SBH",
                                          **kw)
        parts.append(_blank_rows(cat, *part, rows) if rows < c else part)
    if not reached:
        return None
    return cat([p[0] for p in parts], 1), cat([p[1] for p in parts], 0), cat([p[2] for p in parts], 0)


def blocks(backend, q, k, v, ends, rank: int, owner: int, size: int, c: int, **kw):
    """(partials for the first local chunk, partials for the second) of the block from ring rank
    `owner`; q holds chunks rank and 2N-1-rank, k/v chunks owner and 2N-1-owner."""
    mine, theirs = (rank, 2 * size - 1 - rank), (owner, 2 * size - 1 - owner)
    halves = ((q[:c], mine[0]), (q[c:], mine[1]))
    keys = ((k[:c], v[:c], theirs[0]), (k[c:], v[c:], theirs[1]))
    out = ([], [])
    for h, (qh, cq) in enumerate(halves):
        for kh, vh, ck in keys:
            if ck == cq:
                out[h].append(diagonal(backend, qh, kh, vh, ends, cq, c, **kw))
            elif ck < cq:
                part = earlier(backend, qh, kh, vh, ends, cq, ck, c, **kw)
                if part is not None:
                    out[h].append(part)
    return out
