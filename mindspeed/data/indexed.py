"""Write and check Megatron indexed datasets (<prefix>.bin + <prefix>.idx).

Writing goes through megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder; files land
under a temporary name and are renamed at the end, so an interrupted run never leaves a
half-written dataset that looks complete. `check_dataset` turns a missing, truncated or corrupt
pair into a clear DataError before training starts.
"""
from __future__ import annotations

import os
from typing import Iterable

import numpy as np

from megatron.core.datasets.indexed_dataset import (DType, IndexedDataset, IndexedDatasetBuilder,
                                                    get_bin_path, get_idx_path)


class DataError(ValueError):
    """Missing, truncated or corrupt dataset files."""


def token_dtype(vocab_size: int):
    return DType.optimal_dtype(vocab_size)


def write_dataset(prefix: str, documents: Iterable[np.ndarray], vocab_size: int) -> dict:
    """Write one document per array; return counts. Files 0640, parent dir 0750 when created."""
    parent = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o750, exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    dtype = token_dtype(vocab_size)
    builder = IndexedDatasetBuilder(get_bin_path(tmp), dtype=dtype)
    docs = tokens = 0
    for ids in documents:
        if len(ids) == 0:
            continue
        if int(np.max(ids)) >= vocab_size or int(np.min(ids)) < 0:
            raise DataError(f"token id outside [0, {vocab_size}) while writing {prefix!r}")
        builder.add_document(ids, [len(ids)])
        docs += 1
        tokens += len(ids)
    builder.finalize(get_idx_path(tmp))
    if docs == 0:
        for path in (get_bin_path(tmp), get_idx_path(tmp)):
            os.remove(path)
        raise DataError(f"no text found for {prefix!r}: every input document was empty")
    for make in (get_bin_path, get_idx_path):
        os.chmod(make(tmp), 0o640)
        os.replace(make(tmp), make(prefix))
    return {"documents": docs, "tokens": tokens, "dtype": np.dtype(dtype).name}


def check_dataset(prefix: str, vocab_size: int | None = None) -> IndexedDataset:
    """Open the dataset and verify header, sizes and (optionally) the token range."""
    bin_path, idx_path = get_bin_path(prefix), get_idx_path(prefix)
    missing = [p for p in (bin_path, idx_path) if not os.path.isfile(p)]
    if missing:
        raise DataError(f"dataset {prefix!r} is missing {', '.join(missing)}; build it with "
                        "`python -m mindspeed.data --input FILE... --output-prefix PREFIX`")
    try:
        ds = IndexedDataset(prefix)
    except (AssertionError, ValueError, OSError, KeyError) as err:
        raise DataError(f"dataset index {idx_path!r} is corrupt or not a Megatron index: {err}") from err
    index = ds.index
    expected = int(np.sum(index.sequence_lengths, dtype=np.int64)) * index.dtype_size
    actual = os.path.getsize(bin_path)
    if actual != expected:
        raise DataError(f"dataset {bin_path!r} has {actual} bytes but its index describes {expected}: "
                        "the files are truncated or do not belong together; rebuild them")
    if len(index) == 0:
        raise DataError(f"dataset {prefix!r} holds no sequences")
    if vocab_size is not None:
        sample = np.asarray(ds.get(0))
        if sample.size and int(sample.max()) >= vocab_size:
            raise DataError(f"dataset {prefix!r} holds token ids >= vocab size {vocab_size}: "
                            "it was made with a different tokenizer")
    return ds
