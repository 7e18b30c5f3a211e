"""Autograd around collectives started earlier with the interface's async calls.

The pattern: start the collective on a detached input (comm.*_async returns a handle at once),
compute something else, then `finish(handle, x, backward)`: its forward waits for the result, its
backward runs `backward(grad)` (the adjoint collective) so gradients reach `x`. The overlap is in
forward; backward communicates synchronously, in autograd's order.

COUNTS records what ran (read by the tests and the benchmark): collectives started
asynchronously, and expert computations that ran while at least one was still in flight.
"""
from __future__ import annotations

import torch

COUNTS = {"started": 0, "waited": 0, "overlapped_compute": 0}
_IN_FLIGHT = [0]


def reset_counts() -> None:
    COUNTS.update(started=0, waited=0, overlapped_compute=0)
    _IN_FLIGHT[0] = 0


def started(handle):
    COUNTS["started"] += 1
    _IN_FLIGHT[0] += 1
    return handle


def computing() -> None:
    """Called right before compute that is meant to overlap: counts it when a collective is in flight."""
    if _IN_FLIGHT[0] > 0:
        COUNTS["overlapped_compute"] += 1


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle, backward):
        ctx.backward_fn = backward
        COUNTS["waited"] += 1
        _IN_FLIGHT[0] -= 1
        return handle.wait()

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad.contiguous()), None, None


def finish(handle, x, backward):
    """Wait for `handle` (started on x.detach()); gradients flow to x through `backward`."""
    if not x.requires_grad:
        COUNTS["waited"] += 1
        _IN_FLIGHT[0] -= 1
        return handle.wait()
    return _Finish.apply(x, handle, backward)
