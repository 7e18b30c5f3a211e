"""Shaping instruction samples before they are written: --seq-length, --pack, --pad-to-multiple-of.

Without --pack a sample longer than --seq-length is dropped (and counted), as MindSpeed-LLM does.
--pack fills bins of --seq-length tokens with whole samples (first-fit, longest first: the same
input always gives the same packs) and pads each bin to exactly --seq-length with the pad token,
label -100. --pad-to-multiple-of N pads each sample to a multiple of N the same way.
--neat-pack (with --pack, as MindSpeed-LLM) stores in `attention_mask` the number (1, 2, ...) of the
sample each token of a bin belongs to and 0 on the padding, so the trainer can keep attention and
positions inside each sample.
"""
from __future__ import annotations

import bisect

import numpy as np

from mindspeed.data.handlers import IGNORE_INDEX


def fits(samples: list[dict], seq_length: int | None) -> tuple[list[dict], int]:
    """(kept samples, number dropped as longer than seq_length)."""
    if seq_length is None:
        return samples, 0
    kept = [s for s in samples if len(s["input_ids"]) <= seq_length]
    return kept, len(samples) - len(kept)


def pad(sample: dict, length: int, pad_id: int, mask_fill: int = 1) -> dict:
    extra = length - len(sample["input_ids"])
    if extra <= 0:
        return sample
    fill = {"input_ids": pad_id, "attention_mask": mask_fill, "labels": IGNORE_INDEX}
    return {k: np.concatenate([v, np.full(extra, fill[k], dtype=v.dtype)]) for k, v in sample.items()}


def pad_to_multiple(sample: dict, multiple: int, pad_id: int) -> dict:
    n = len(sample["input_ids"])
    return pad(sample, -(-n // multiple) * multiple, pad_id)


def bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices grouped into bins of total length <= capacity: best fit, longest sample first (ties in
    input order), so the same lengths always give the same bins. O(n log n) bisection on the rooms."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    rooms: list[tuple[int, int]] = []        # (free room, bin number), sorted
    for i in order:
        at = bisect.bisect_left(rooms, (lengths[i], -1))
        if at == len(rooms):
            groups.append([i])
            room, number = capacity - lengths[i], len(groups) - 1
        else:
            room, number = rooms.pop(at)
            groups[number].append(i)
            room -= lengths[i]
        bisect.insort(rooms, (room, number))
    return groups


def pack(samples: list[dict], seq_length: int, pad_id: int, neat: bool = False) -> list[dict]:
    groups = bins([len(s["input_ids"]) for s in samples], seq_length)
    packed = []
    for group in groups:
        # --neat-pack: the sample's number within its bin replaces its all-ones mask
        parts = [_numbered(samples[i], n + 1) if neat else samples[i] for n, i in enumerate(group)]
        joined = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        packed.append(pad(joined, seq_length, pad_id, mask_fill=0 if neat else 1))
    return packed


def _numbered(sample: dict, number: int) -> dict:
    return {**sample, "attention_mask": np.full_like(sample["attention_mask"], number)}
