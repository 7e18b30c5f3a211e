"""custom_op on MindSpore: a Cell whose bprop is the user's backward (PyNative mode); and
with_gradient, a custom gradient that also holds inside a jit-traced forward."""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindspeed.backends.base import AutogradAPI


class _Ctx:
    """What forward/backward receive: `save(*tensors)`, `saved`, and free attributes."""

    def __init__(self):
        self.saved = ()

    def save(self, *tensors):
        self.saved = tensors


class _CustomOpCell(nn.Cell):
    def __init__(self, forward, backward):
        super().__init__()
        self._forward, self._backward = forward, backward
        self.ctx = _Ctx()

    def construct(self, *inputs):
        return self._forward(self.ctx, *inputs)

    def bprop(self, *args):
        inputs, dout = args[:-2], args[-1]
        grads = self._backward(self.ctx, *(dout if isinstance(dout, tuple) else (dout,)))
        if not isinstance(grads, (tuple, list)):
            grads = (grads,)
        if len(grads) < len(inputs):
            raise ValueError(f"custom_op backward returned {len(grads)} gradients for {len(inputs)} inputs")
        # MindSpore wants a gradient for every input: None (not differentiable) becomes zeros
        return tuple(ops.zeros_like(x) if g is None else g for x, g in zip(inputs, grads))


class MsAutograd(AutogradAPI):
    def custom_op(self, forward, backward):
        """One Cell per call keeps each call's ctx separate. Only tensor inputs enter the Cell
        (its bprop must return a gradient per input); the others (groups, flags, sizes) reach
        forward in their places by closure, and backward's entries for them are dropped."""
        def apply(*inputs):
            at = [i for i, x in enumerate(inputs) if isinstance(x, ms.Tensor)]
            if len(at) == len(inputs):
                return _CustomOpCell(forward, backward)(*inputs)

            def fwd(ctx, *tensors):
                full = list(inputs)
                for i, t in zip(at, tensors):
                    full[i] = t
                return forward(ctx, *full)

            def bwd(ctx, *douts):
                grads = backward(ctx, *douts)
                grads = grads if isinstance(grads, (tuple, list)) else (grads,)
                return tuple(grads[i] for i in at)
            return _CustomOpCell(fwd, bwd)(*(inputs[i] for i in at))
        apply.__name__ = getattr(forward, "__name__", "custom_op")
        return apply


_TAPS: dict = {}


def _gradient_tap(out_shape: tuple, backward, key):
    """ops.Custom (pyfunc) whose forward is zeros of out_shape and whose bprop is backward(dout).
    A primitive's bprop is what graph autodiff of a jit-traced forward uses: the trace records
    primitives only and never calls a Cell's bprop. Cached: one primitive per (key, shape)."""
    cache_key = (key, out_shape)
    if cache_key not in _TAPS:
        def zeros(x):
            return np.zeros(out_shape, x.dtype)

        def bprop(x, out, dout):      # a def, not a lambda: MindSpore parses this function's source
            return (backward(dout),)
        _TAPS[cache_key] = ops.Custom(zeros, out_shape=lambda _: out_shape, out_dtype=lambda t: t,
                                      func_type="pyfunc", bprop=bprop)
    return _TAPS[cache_key]


def with_gradient(forward, x, backward, key):
    """forward(x) whose gradient w.r.t. x is backward(dout), in PyNative and in a traced graph
    alike: forward(stop_gradient(x)) + tap(x), the tap being exact zeros forward. The stop is on
    forward's input, not its output: autodiff then builds no backward for forward's collectives
    at all (one past its output would still run, all-reducing zeros). `key` names the backward
    (same key, same backward): backward must use only primitives and Python constants, as
    MindSpore compiles it into the graph's backward."""
    value = forward(ops.stop_gradient(x))
    return value + _gradient_tap(tuple(value.shape), backward, key)(x)
