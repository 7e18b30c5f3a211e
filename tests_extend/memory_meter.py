"""Bytes held for backward: every tensor autograd saves during a forward, counted once per
storage, sized after the forward has returned (so storage a feature frees after its consumer ran,
as the recompute features do, counts 0). Shared by the memory tests and bench_memory.py."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def saved_for_backward():
    """with saved_for_backward() as meter: loss = model(...)   then meter.nbytes()"""
    import torch
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages.setdefault(s._cdata, (s, t.dtype))   # one entry per storage, whatever views were saved
        return t

    meter = _Meter(storages)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield meter


class _Meter:
    def __init__(self, storages):
        self._storages = storages

    def nbytes(self, exclude=(), dtype=None) -> int:
        """Saved bytes; `exclude`: tensors (parameters) whose storage is not an activation;
        `dtype`: only storages first saved as that dtype (e.g. torch.bool for masks)."""
        skip = {t.untyped_storage()._cdata for t in exclude}
        return sum(s.nbytes() for k, (s, dt) in self._storages.items()
                   if k not in skip and (dtype is None or dt == dtype))

    def count(self, dtype=None) -> int:
        return sum(1 for s, dt in self._storages.values() if dtype is None or dt == dtype)

    def freed(self) -> int:
        """Saved storages already freed when asked (a recompute feature's discarded outputs)."""
        return sum(1 for s, _ in self._storages.values() if s.nbytes() == 0)


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@contextlib.contextmanager
def ms_saved_for_backward():
    """MindSpore (PyNative): the same count through mindspore.saved_tensors_hooks. Forward and
    backward run inside one value_and_grad call, so the function being differentiated calls
    `meter.snapshot()` at the end of its forward; nbytes() is that snapshot."""
    import mindspore as ms
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        key = s.data_ptr()
        if key in storages and storages[key].nbytes() == 0:
            key = (key, len(storages))    # that storage was freed: this is a new one at its address
        storages.setdefault(key, s)
        return t

    meter = _MsMeter(storages)
    with ms.saved_tensors_hooks(pack, lambda t: t):
        yield meter


class _MsMeter:
    def __init__(self, storages):
        self._storages, self._snapshot = storages, None

    def snapshot(self, exclude=()) -> None:
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        sizes = [s.nbytes() for k, s in self._storages.items() if k not in skip]
        self._snapshot = (sum(sizes), sizes.count(0))

    def nbytes(self) -> int:
        return self._snapshot[0]

    def freed(self) -> int:
        """Saved storages that were empty at the snapshot (freed after use, to be rebuilt)."""
        return self._snapshot[1]
