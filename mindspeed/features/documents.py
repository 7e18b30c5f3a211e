"""Packed documents (--reset-attention-mask): where each document of a micro-batch ends.

With EOD reset, attention stays inside each document. Instead of Megatron's dense [s, s] mask the
kernel path takes the documents' cumulative ends (the TND layout's actual_seq_qlen): computed once
per micro-batch from the EOD positions (a document ends right after its EOD token, as Megatron's
mask has it), before context-parallel sharding.

They travel with the micro-batch, as its attention_mask: an int32 [b, k] tensor of each sample's
ends, zero-padded (`padded_rows`; Megatron's masks are bool or float, so the dtype tells them
apart). Megatron hands attention_mask unchanged from the model's forward to every core attention,
through the pipeline schedule (each micro-batch's forward gets its own) and activation recompute
(which re-runs a layer on detached copies of its inputs: the values survive where an attribute
would not). Framework-free: rows and masks are anything with .tolist(); attention runs on the
kernels its caller passes (the run's backend's).
"""
from __future__ import annotations


def ends_from_eod(tokens_row, eod: int) -> list[int]:
    """Cumulative ends (no leading 0, last = s) of the documents in one sample of tokens."""
    row = [int(t) for t in tokens_row.tolist()]
    s = len(row)
    return [i + 1 for i, t in enumerate(row) if t == eod and i + 1 < s] + [s]


def ends_from_segments(segments_row) -> list[int]:
    """Cumulative ends of runs of equal sample numbers (--neat-pack's segments)."""
    row = [int(t) for t in segments_row.tolist()]
    return [i for i in range(1, len(row)) if row[i] != row[i - 1]] + [len(row)]


def padded_rows(ends: list[list[int]]) -> list[list[int]]:
    """Each sample's ends, zero-padded to one width: the values of the attention_mask that carries them."""
    width = max(len(row) for row in ends)
    return [list(row) + [0] * (width - len(row)) for row in ends]


def carries_ends(mask) -> bool:
    """Whether an attention_mask is the documents' ends (int32) rather than a mask."""
    return mask is not None and str(getattr(mask, "dtype", "")).lower().endswith("int32")


def ends_in(mask) -> list[list[int]] | None:
    """The documents (one list of ends per sample) an attention_mask carries, or None: a mask or no mask."""
    if not carries_ends(mask):
        return None
    return [[e for e in row if e > 0] for row in mask.tolist()]


def packed_ends(ends: list[list[int]], s: int) -> list[int]:
    """The samples' document ends as one TND sequence list ([b*s] tokens, sample-major)."""
    return [i * s + e for i, row in enumerate(ends) for e in row]


def check(ends: list[list[int]], b: int, s: int) -> None:
    if len(ends) != b or any(not row or row[-1] != s for row in ends):
        raise ValueError(f"document ends {ends} do not describe {b} sample(s) of {s} tokens")


def attention(q, k, v, ends: list[list[int]], *, kernels, head_num: int, **kwargs):
    """Attention inside each document: q [s, b, n*d], k/v [s, b, nkv*d] (SBH; v's head size may be its
    own) whose samples hold documents ending at `ends` (per sample, cumulative over s) -> (out
    [s, b, n*dv], softmax max and sum [b, n, s]). One TND call of kernels.attention packs the samples
    one after another."""
    s, b, h = q.shape
    d = h // head_num
    check(ends, b, s)
    kv_heads = k.shape[2] // d
    tnd = lambda t, heads: t.swapaxes(0, 1).reshape(b * s, heads, t.shape[2] // heads)
    packed = packed_ends(ends, s)
    out, mx, sm = kernels.attention(tnd(q, head_num), tnd(k, kv_heads), tnd(v, kv_heads), layout="TND",
                                    head_num=head_num, actual_seq_qlen=packed, actual_seq_kvlen=packed, **kwargs)
    stats = lambda t: t.reshape(b, s, head_num).permute(0, 2, 1)
    return out.reshape(b, s, -1).swapaxes(0, 1), stats(mx), stats(sm)


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
