"""Megatron-Core's linear layers as torch's own linear where Megatron's function has nothing to add.

Megatron's `linear_with_grad_accumulation_and_async_allreduce` is a Python autograd Function: it
exists for what it does around the GEMM (the tensor-parallel all-reduce of the input gradient,
sequence parallelism's gathers, gradient-accumulation fusion into main_grad, deferred embedding
wgrads). A call that asks for none of these (every linear at TP=1, the row-parallel ones at any
TP) computes input @ weight.T + bias and its gradients, which is torch.nn.functional.linear: one
addmm with the bias inside and a native backward, without the Function's Python forward and
backward on every call. Calls that ask for any of them keep Megatron's Function.
"""
from __future__ import annotations

import functools

import torch.nn.functional as F

SITE = "megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce"


def needs_megatron_function(gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
                            grad_output_buffer) -> bool:
    return bool(gradient_accumulation_fusion or allreduce_dgrad or sequence_parallel or grad_output_buffer is not None)


def _wrap_linear(original):
    def linear_with_grad_accumulation_and_async_allreduce(input, weight, bias, gradient_accumulation_fusion,
                                                          allreduce_dgrad, sequence_parallel, grad_output_buffer=None,
                                                          *args, **kwargs):
        if needs_megatron_function(gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                                   grad_output_buffer):
            return original(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                            grad_output_buffer, *args, **kwargs)
        return F.linear(input, weight, bias)
    # the original reads its own attributes (`.warned`) through its module global, which this becomes
    return functools.update_wrapper(linear_with_grad_accumulation_and_async_allreduce, original)


def apply_native_linear(patcher) -> None:
    import megatron.core.tensor_parallel.layers  # noqa: F401  (the site's module)
    patcher.wrap(SITE, _wrap_linear, reason="a linear with no communication or fusion runs as torch's F.linear",
                 aliases="megatron")
