"""Autograd around collectives started earlier with the interface's async calls, and the counters
of what overlapped.

The pattern: start the collective on a detached input (comm.*_async returns a handle at once),
compute something else, then `finish(handle, x, backward)`: its forward waits for the result, its
backward runs `backward(grad)` (the adjoint collective) so gradients reach `x`. That overlaps in
forward only; the chunked pipeline's backward overlap has its own nodes (chunked_alltoall.py).

COUNTS records what ran (read by the tests and the benchmark): collectives started
asynchronously and waited for, and computations that ran while at least one was still in flight
(started, not yet waited for); the bwd_* keys the same for gradient collectives started during
backward and expert backward computations. BACKWARD_ORDER: the last gradient collectives started,
in order (bounded), so a test can check every rank issues them alike.
"""
from __future__ import annotations

import collections

import torch

COUNTS = {"started": 0, "waited": 0, "overlapped_compute": 0,
          "bwd_started": 0, "bwd_waited": 0, "bwd_overlapped_compute": 0}
BACKWARD_ORDER: collections.deque = collections.deque(maxlen=64)
_IN_FLIGHT = {"fwd": 0, "bwd": 0}


def reset_counts() -> None:
    COUNTS.update(dict.fromkeys(COUNTS, 0))
    _IN_FLIGHT.update(fwd=0, bwd=0)
    BACKWARD_ORDER.clear()


def started(handle):
    COUNTS["started"] += 1
    _IN_FLIGHT["fwd"] += 1
    return handle


def waited(handle):
    """handle.wait(), counted."""
    COUNTS["waited"] += 1
    _IN_FLIGHT["fwd"] -= 1
    return handle.wait()


def computing() -> None:
    """Called right before compute that is meant to overlap: counts it when a collective is in flight."""
    if _IN_FLIGHT["fwd"] > 0:
        COUNTS["overlapped_compute"] += 1


def started_backward(handle, label: str):
    COUNTS["bwd_started"] += 1
    _IN_FLIGHT["bwd"] += 1
    BACKWARD_ORDER.append(label)
    return handle


def waited_backward(handle):
    COUNTS["bwd_waited"] += 1
    _IN_FLIGHT["bwd"] -= 1
    return handle.wait()


def computing_backward() -> None:
    """Called right before an expert backward: counts it when a gradient collective is in flight."""
    if _IN_FLIGHT["bwd"] > 0:
        COUNTS["bwd_overlapped_compute"] += 1


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle, backward):
        ctx.backward_fn = backward
        return waited(handle)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad.contiguous()), None, None


def finish(handle, x, backward):
    """Wait for `handle` (started on x.detach()); gradients flow to x through `backward`."""
    if not x.requires_grad:
        return waited(handle)
    return _Finish.apply(x, handle, backward)
