"""Weights keep their object identity through --swap-attention's saved-tensor hooks.

With saved-tensor hooks active, autograd hands backward a new tensor object for every saved
tensor, weights included, so attributes set on the Parameter are gone there. Megatron-Core's
linear function reads `weight.main_grad` from its saved weight in backward when gradient
accumulation fusion is on (the default); core_v0.12.1 had no other way to it, and newer cores
also keep `grad_added_to_main_grad` on the Parameter. Without hooks backward gets the Parameter
itself; this patch gives it the same inside the swap, so the math is that of the run without it.
"""
from __future__ import annotations

import functools

LINEAR = "megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication"


class _SavedWithParameters:
    """The backward context, except that `saved_tensors` answers the forward's Parameters for
    the tensors autograd rebuilt from them."""

    def __init__(self, ctx, parameters):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "_parameters", parameters)

    def _original(self, tensor):
        for parameter in self._parameters:
            if (tensor is not None and tensor.data_ptr() == parameter.data_ptr()
                    and tensor.shape == parameter.shape and tensor.dtype == parameter.dtype):
                return parameter
        return tensor

    @property
    def saved_tensors(self):
        return tuple(self._original(t) for t in self._ctx.saved_tensors)

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


def install(patcher, memory) -> None:
    """memory: the backend's memory part (is_parameter: a trainable leaf)."""
    reason = "--swap-attention: backward gets the saved weight Parameter itself (its main_grad)"

    def wrap_forward(forward):
        @functools.wraps(forward)
        def run(ctx, *args, **kwargs):
            # a reference, not a copy: the Parameter lives in its module anyway
            ctx.mindspeed_parameters = [a for a in args if memory.is_parameter(a)]
            return forward(ctx, *args, **kwargs)
        return run

    def wrap_backward(backward):
        @functools.wraps(backward)
        def run(ctx, *grads):
            parameters = getattr(ctx, "mindspeed_parameters", None)
            return backward(_SavedWithParameters(ctx, parameters) if parameters else ctx, *grads)
        return run

    patcher.wrap(f"{LINEAR}.forward", wrap_forward, reason=reason)
    patcher.wrap(f"{LINEAR}.backward", wrap_backward, reason=reason)
