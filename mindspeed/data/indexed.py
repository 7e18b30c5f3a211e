"""Write Megatron indexed datasets (<prefix>.bin + <prefix>.idx); `indexed_reader` reads and checks them.

Writing goes through megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder; files land
under a temporary name and are renamed at the end, so an interrupted run never leaves a
half-written dataset that looks complete.
"""
from __future__ import annotations

import os
from typing import Iterable

import numpy as np

from megatron.core.datasets.indexed_dataset import (DType, IndexedDataset, IndexedDatasetBuilder,
                                                    get_bin_path, get_idx_path)

from mindspeed.data.errors import DataError


def token_dtype(vocab_size: int):
    return DType.optimal_dtype(vocab_size)


class DatasetGroup:
    """Several indexed datasets written side by side (one document each per `add`), under temporary
    names until `commit` renames them all: a failure leaves nothing that looks complete.

    `prefixes` maps a key to its output prefix; `dtypes` a key to its token dtype; `vocab_size`
    (optional) bounds the keys listed in `checked`."""

    def __init__(self, prefixes: dict, dtypes: dict, vocab_size: int | None = None, checked=()):
        self.prefixes, self.vocab_size, self.checked = dict(prefixes), vocab_size, set(checked)
        for prefix in self.prefixes.values():
            parent = os.path.dirname(os.path.abspath(prefix))
            if not os.path.isdir(parent):
                os.makedirs(parent, mode=0o750, exist_ok=True)
        self.temp = {k: f"{p}.tmp{os.getpid()}" for k, p in self.prefixes.items()}
        self.builders = {k: IndexedDatasetBuilder(get_bin_path(t), dtype=dtypes[k]) for k, t in self.temp.items()}
        self.documents = self.tokens = 0

    def add(self, arrays: dict) -> None:
        for key, ids in arrays.items():
            if key in self.checked and len(ids) and (int(np.max(ids)) >= self.vocab_size or int(np.min(ids)) < 0):
                raise DataError(f"token id outside [0, {self.vocab_size}) while writing {self.prefixes[key]!r}")
            self.builders[key].add_document(ids, [len(ids)])
        self.documents += 1
        self.tokens += len(next(iter(arrays.values())))

    def append(self, prefixes: dict) -> None:
        """Append whole datasets written before (one per key), e.g. the parts of --n-subs."""
        for key, prefix in prefixes.items():
            self.builders[key].add_index(prefix)
        first = IndexedDataset(next(iter(prefixes.values()))).index
        self.documents += len(first.document_indices) - 1
        self.tokens += int(np.sum(first.sequence_lengths, dtype=np.int64))

    def commit(self, allow_empty: bool = False) -> None:
        """Rename the datasets into place; none written is an error unless `allow_empty` (a part of
        --n-subs whose records were all dropped)."""
        for key, builder in self.builders.items():
            builder.finalize(get_idx_path(self.temp[key]))
        if self.documents == 0 and not allow_empty:
            self.abort()
            raise DataError(f"no documents for {', '.join(map(repr, self.prefixes.values()))}: "
                            "every input record was empty or dropped")
        for key, temp in self.temp.items():
            for make in (get_bin_path, get_idx_path):
                os.chmod(make(temp), 0o640)
                os.replace(make(temp), make(self.prefixes[key]))

    def abort(self) -> None:
        for builder in self.builders.values():
            builder.data_file.close()
        remove_dataset(*self.temp.values())


def remove_dataset(*prefixes: str) -> None:
    for prefix in prefixes:
        for path in (get_bin_path(prefix), get_idx_path(prefix)):
            if os.path.exists(path):
                os.remove(path)


def write_dataset(prefix: str, documents: Iterable[np.ndarray], vocab_size: int) -> dict:
    """Write one document per array (empty ones skipped); return counts. Files 0640, parent dir
    0750 when created."""
    dtype = token_dtype(vocab_size)
    group = DatasetGroup({"": prefix}, {"": dtype}, vocab_size, checked=[""])
    try:
        for ids in documents:
            if len(ids):
                group.add({"": ids})
        group.commit()
    except BaseException:
        group.abort()
        raise
    return {"documents": group.documents, "tokens": group.tokens, "dtype": np.dtype(dtype).name}
