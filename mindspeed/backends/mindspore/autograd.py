"""custom_op on MindSpore: a Cell whose bprop is the user's backward (PyNative mode)."""
from __future__ import annotations

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
        """Inputs must be tensors (pass constants through a closure); one Cell per call keeps
        each call's ctx separate."""
        def apply(*inputs):
            return _CustomOpCell(forward, backward)(*inputs)
        apply.__name__ = getattr(forward, "__name__", "custom_op")
        return apply
