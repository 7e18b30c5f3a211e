"""Packed documents (--reset-attention-mask): where each document of a micro-batch ends.

With EOD reset, attention stays inside each document. Instead of Megatron's dense [s, s] mask the
kernel path takes the documents' cumulative ends (the TND layout's actual_seq_qlen): computed once
per micro-batch from the EOD positions (a document ends right after its EOD token, as Megatron's
mask has it), before context-parallel sharding, and read by every attention layer of that
micro-batch. Framework-free: rows are anything with .tolist().
"""
from __future__ import annotations

from mindspeed.backends import get_backend

_current = {"ends": None}      # per sample: cumulative document ends over the whole sequence


def ends_from_eod(tokens_row, eod: int) -> list[int]:
    """Cumulative ends (no leading 0, last = s) of the documents in one sample of tokens."""
    row = [int(t) for t in tokens_row.tolist()]
    s = len(row)
    return [i + 1 for i, t in enumerate(row) if t == eod and i + 1 < s] + [s]


def ends_from_segments(segments_row) -> list[int]:
    """Cumulative ends of runs of equal sample numbers (--neat-pack's segments)."""
    row = [int(t) for t in segments_row.tolist()]
    return [i for i in range(1, len(row)) if row[i] != row[i - 1]] + [len(row)]


def set_current(ends: list[list[int]] | None) -> None:
    """The micro-batch's documents (one list per sample), or None: plain causal attention."""
    _current["ends"] = ends


def current() -> list[list[int]] | None:
    return _current["ends"]


def packed_ends(ends: list[list[int]], s: int) -> list[int]:
    """The samples' document ends as one TND sequence list ([b*s] tokens, sample-major)."""
    return [i * s + e for i, row in enumerate(ends) for e in row]


def check(ends: list[list[int]], b: int, s: int) -> None:
    if len(ends) != b or any(not row or row[-1] != s for row in ends):
        raise ValueError(f"document ends {ends} do not describe {b} sample(s) of {s} tokens")


def attention(q, k, v, ends: list[list[int]], *, head_num: int, **kwargs):
    """Attention inside each document: q [s, b, n*d], k/v [s, b, nkv*d] (SBH) whose samples hold
    documents ending at `ends` (per sample, cumulative over s) -> (out [s, b, n*d], softmax max and
    sum [b, n, s]). One TND kernel call packs the samples one after another."""
    s, b, h = q.shape
    d = h // head_num
    check(ends, b, s)
    tnd = lambda t: t.swapaxes(0, 1).reshape(b * s, t.shape[2] // d, d)
    packed = packed_ends(ends, s)
    out, mx, sm = get_backend().kernels.attention(tnd(q), tnd(k), tnd(v), layout="TND", head_num=head_num,
                                                  actual_seq_qlen=packed, actual_seq_kvlen=packed, **kwargs)
    stats = lambda t: t.reshape(b, s, head_num).permute(0, 2, 1)
    return out.reshape(b, s, h).swapaxes(0, 1), stats(mx), stats(sm)


def within(ends: list[list[int]], start: int, end: int) -> list[list[int]]:
    """The documents' ends inside tokens [start, end) of every sample, relative to start."""
    out = []
    for row in ends:
        part = []
        for e in row:
            if e > start:
                part.append(min(e, end) - start)
                if e >= end:
                    break
        out.append(part)
    return out


def document_start(row: list[int], position: int) -> int:
    """Where the document holding token `position` begins."""
    return max([e for e in row if e <= position], default=0)


def document_end(row: list[int], position: int) -> int:
    """Where the document holding token `position` ends (exclusive)."""
    return min(e for e in row if e > position)
