"""--data-cache-path for the MindSpore trainer: each sample stream's shuffle order (its sample index,
one permutation per epoch) kept in files and read back by the next run, as Megatron's GPTDataset
keeps its index files there.

Files are named by a hash of the stream's description (dataset, documents, tokens, sequence length,
seed, split), so a run with other settings never reads them: `<hash>-<split>-description.json` and
`<hash>-<split>-shuffle_epoch<e>.npy`. Every rank reads a file that exists and writes one that does
not (one rename: ranks writing the same order at once leave one whole file). A file that is not a
permutation of the stream's samples, or a description that differs from the run's, is refused in
one line naming it: it was edited, cut short or written by something else.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from mindspeed.data.errors import DataError
from mindspeed.files import atomic_write, atomic_write_text


class OrderCache:
    """Where one stream's per-epoch orders live; counts what it read and wrote (for the log)."""

    def __init__(self, directory: str, description: dict):
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.description = json.dumps(description, sort_keys=True)
        digest = hashlib.md5(self.description.encode()).hexdigest()
        self.base = os.path.join(self.directory, f"{digest}-{description['split']}")
        self.read, self.written = 0, 0

    def order(self, epoch: int, num_samples: int, build) -> np.ndarray:
        """Epoch `epoch`'s order: from its file, else build() saved to it."""
        path = f"{self.base}-shuffle_epoch{epoch}.npy"
        if os.path.isfile(path):
            self._check_description()
            order = self._load(path, num_samples)
            self.read += 1
            return order
        order = build()
        os.makedirs(self.directory, exist_ok=True)
        self._write_description()
        atomic_write(path, lambda tmp: _save(tmp, order))
        self.written += 1
        return order

    def _load(self, path: str, num_samples: int) -> np.ndarray:
        try:
            order = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise self._refuse(path, f"cannot be read ({err})") from None
        if order.shape != (num_samples,) or order.dtype.kind not in "iu" or \
                not np.array_equal(np.sort(order), np.arange(num_samples)):
            raise self._refuse(path, f"is not an order of this split's {num_samples} samples")
        return order

    def _check_description(self) -> None:
        path = f"{self.base}-description.json"
        try:
            with open(path, encoding="utf-8") as f:
                found = f.read()
        except OSError:
            raise self._refuse(path, "is missing beside its order files") from None
        if found != self.description:
            raise self._refuse(path, "describes another dataset or settings than this run's")

    def _write_description(self) -> None:
        path = f"{self.base}-description.json"
        if not os.path.isfile(path):
            atomic_write_text(path, self.description)

    @staticmethod
    def _refuse(path: str, why: str) -> DataError:
        return DataError(f"--data-cache-path: {path} {why}; delete it (the next run writes it again)")


def _save(path: str, order: np.ndarray) -> None:
    with open(path, "wb") as f:      # np.save(path) would add ".npy" to the temporary name
        np.save(f, order)


def order_cache(args, description: dict) -> OrderCache | None:
    """The cache --data-cache-path names for a stream so described, or None without the flag."""
    directory = args.data_cache_path
    return OrderCache(directory, description) if directory else None
