"""Megatron indexed datasets (<prefix>.bin + <prefix>.idx, the MMIDIDX format) read with numpy:
the one reader both trainers and every dataset check use. No torch, no Megatron, so the MindSpore
trainer runs where neither is installed. Writing is `indexed.py` (Megatron's own builder).

Also Megatron's `--split` rule (contiguous document ranges for train/valid/test); each trainer
keeps its own sampling order on top.
"""
from __future__ import annotations

import os
import struct

import numpy as np

from mindspeed.data.errors import DataError

_HEADER = b"MMIDIDX\x00\x00"
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
           8: np.uint16}
_BUILD_HINT = "build it with `python -m mindspeed.data --input FILE... --output-prefix PREFIX`"


class IndexedTokens:
    """The token stream of one indexed dataset, memory-mapped, its sizes checked on open."""

    def __init__(self, prefix: str):
        idx, binf = prefix + ".idx", prefix + ".bin"
        missing = [p for p in (binf, idx) if not os.path.isfile(p)]
        if missing:
            raise DataError(f"dataset {prefix!r} is missing {', '.join(missing)}; {_BUILD_HINT}")
        with open(idx, "rb") as f:
            head = f.read(len(_HEADER) + 8 + 1 + 8 + 8)
        if len(head) < 34 or head[:9] != _HEADER:
            raise DataError(f"dataset index {idx!r} is corrupt or not a Megatron index (bad header)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:34])
        if version != 1 or code not in _DTYPES:
            raise DataError(f"dataset index {idx!r}: unsupported index version {version} or dtype code {code}")
        self.dtype = np.dtype(_DTYPES[code])
        index_bytes = 34 + n_seq * 4 + n_seq * 8 + n_doc * 8
        if os.path.getsize(idx) < index_bytes:
            raise DataError(f"dataset index {idx!r} is truncated: it is {os.path.getsize(idx)} bytes, its "
                            f"header describes {index_bytes}; rebuild the dataset")
        offset = 34
        self.seq_lengths = np.memmap(idx, np.int32, "r", offset, n_seq) if n_seq else np.zeros(0, np.int32)
        offset += n_seq * 4
        self.seq_pointers = np.memmap(idx, np.int64, "r", offset, n_seq) if n_seq else np.zeros(0, np.int64)
        offset += n_seq * 8
        self.doc_index = np.memmap(idx, np.int64, "r", offset, n_doc) if n_doc else np.zeros(1, np.int64)
        expected = int(self.seq_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        actual = os.path.getsize(binf)
        if actual != expected:
            raise DataError(f"dataset {binf!r} has {actual} bytes but its index describes {expected} "
                            f"({self.dtype.name} tokens): the files are truncated or do not belong together; "
                            "rebuild them")
        self.tokens = np.memmap(binf, self.dtype, "r") if expected else np.zeros(0, self.dtype)

    @property
    def num_sequences(self) -> int:
        return len(self.seq_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.doc_index) - 1

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.seq_pointers[i]) // self.dtype.itemsize
        return np.asarray(self.tokens[start:start + int(self.seq_lengths[i])])

    def document_range_tokens(self, first_doc: int, end_doc: int) -> np.ndarray:
        """Tokens of documents [first_doc, end_doc) (contiguous in the .bin file)."""
        if end_doc <= first_doc:
            return np.zeros(0, np.int64)
        first_seq, end_seq = int(self.doc_index[first_doc]), int(self.doc_index[end_doc])
        start = int(self.seq_pointers[first_seq]) // self.dtype.itemsize
        stop = int(self.seq_pointers[end_seq - 1]) // self.dtype.itemsize + int(self.seq_lengths[end_seq - 1])
        return np.asarray(self.tokens[start:stop], dtype=np.int64)


def check_dataset(prefix: str, vocab_size: int | None = None) -> IndexedTokens:
    """The dataset opened, with a clear DataError for missing, truncated, corrupt or empty files,
    or (given `vocab_size`) token ids of another tokenizer in its first sequence."""
    ds = IndexedTokens(prefix)
    if ds.num_sequences == 0:
        raise DataError(f"dataset {prefix!r} holds no sequences")
    if vocab_size is not None:
        first = ds.sequence(0)
        if first.size and int(first.max()) >= vocab_size:
            raise DataError(f"dataset {prefix!r} holds token ids >= vocab size {vocab_size}: "
                            "it was made with a different tokenizer")
    return ds


def split_bounds(split: str, num_docs: int) -> list[tuple[int, int]]:
    """Megatron's split string ("949,50,1") -> document ranges for train, valid, test."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError as err:
        raise DataError(f"--split {split!r} must be comma-separated numbers") from err
    weights = (weights + [0.0, 0.0, 0.0])[:3]
    if sum(weights) <= 0 or any(w < 0 for w in weights):
        raise DataError(f"--split {split!r} needs non-negative weights with a positive sum")
    total = sum(weights)
    ends, acc = [0], 0.0
    for w in weights:
        acc += w / total
        ends.append(int(round(acc * num_docs)))
    ends[-1] = num_docs
    return [(ends[i], ends[i + 1]) for i in range(3)]
