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
        storages[s._cdata] = s          # one entry per storage, whatever views of it were saved
        return t

    meter = _Meter(storages)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield meter


class _Meter:
    def __init__(self, storages):
        self._storages = storages

    def nbytes(self, exclude=()) -> int:
        """Saved bytes; `exclude`: tensors (parameters) whose storage is not an activation."""
        skip = {t.untyped_storage()._cdata for t in exclude}
        return sum(s.nbytes() for k, s in self._storages.items() if k not in skip)


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
