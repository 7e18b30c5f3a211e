"""--swap-attention: tensors a module saves for backward live in host memory between its forward
and its backward. Written once against the backend interface (memory.saved_tensors_hooks,
offload_to_host, reload_to_device); the host hooks only say which modules run inside `scope`.

Each call of a swapped module is one group. Its saved tensors are copied to the host as they are
saved (pack), so the device copies die with the forward's own references. In backward, the first
unpack of a group reloads the whole group and prefetches the group of the layer below (the next
one backward will need), so that layer's copies are in flight while this layer computes.
Trainable leaves (weights) are saved by reference: they stay on the device anyway.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager


class _Group:
    """The saved tensors of one call of one swapped module."""

    def __init__(self, memory, layer, prev, log):
        self.log = log
        # weak links: a group lives only as long as autograd holds what it packed
        self.memory, self.layer, self.prev = memory, layer, prev
        self.host, self.device, self.index = [], None, {}

    def pack(self, tensor):
        # one host copy per base tensor: ops save the same data through several view objects
        # (Megatron's attention probabilities as [b, n, s, s] and as [b*n, s, s]); the weak
        # reference tells a live base from a new one that took a dead one's id
        base, view = self.memory.view_of(tensor)
        known = self.index.get(id(base))
        if known is None or known[0]() is not base:
            known = self.index[id(base)] = (weakref.ref(base), len(self.host))
            self.host.append(self.memory.offload_to_host(base))
        return known[1], view

    def load(self, why: str = "demand") -> None:
        if self.device is None:
            self.log.append((self.layer, why))
            self.device = [self.memory.reload_to_device(h) for h in self.host]
            self.host = None             # the host copies are garbage now (the ledger drops them)

    def unpack(self, item):
        slot, view = item
        if self.device is None:
            self.load()
            below = self.prev() if self.prev is not None else None
            if below is not None:        # prefetch: the layer below is next in backward
                below.load("prefetch")
            self.prev = None
        data = self.device[slot]
        return data if view is None else self.memory.make_view(data, view)


class ActivationSwapper:
    """One per process: links groups in forward order so backward can prefetch."""

    def __init__(self, memory):
        self.memory = memory
        self.last = None
        self.groups = 0       # groups created (a test hook: the swap ran)
        self.loads = []       # (layer, "demand" | "prefetch") of the latest loads, for tests

    @contextmanager
    def scope(self, layer: int):
        """Run a swapped module's forward inside this: what it saves for backward goes to the host."""
        last = self.last() if self.last is not None else None
        prev = weakref.ref(last) if last is not None and last.layer < layer else None
        del self.loads[:-64]
        group = _Group(self.memory, layer, prev, self.loads)
        self.last, self.groups = weakref.ref(group), self.groups + 1
        memory = self.memory

        def pack(tensor):
            if memory.is_parameter(tensor) or memory.is_parameter(memory.view_of(tensor)[0]):
                return (None, tensor)
            return (group, group.pack(tensor))

        def unpack(packed):
            owner, item = packed
            return item if owner is None else owner.unpack(item)

        with memory.saved_tensors_hooks(pack, unpack):
            yield group
