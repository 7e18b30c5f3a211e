"""Megatron-Core's linear layers as torch's own linear where Megatron's function has nothing to add.

Megatron's `linear_with_grad_accumulation_and_async_allreduce` is a Python autograd Function: it
exists for what it does around the GEMM (the tensor-parallel all-reduce of the input gradient,
sequence parallelism's gathers, gradient-accumulation fusion into main_grad, deferred embedding
wgrads). A call that asks for none of these (every linear at TP=1, the row-parallel ones at any
TP) computes input @ weight.T + bias and its gradients, which is torch.nn.functional.linear: one
addmm with the bias inside and a native backward, without the Function's Python forward and
backward on every call. Calls that ask for any of them keep Megatron's Function.

A row-parallel linear over one TP rank goes one step further: Megatron computes its GEMM without
the bias (the bias must follow the all-reduce) and adds the bias apart, or hands it on to
bias-dropout-add. Over one rank there is no all-reduce, so the bias goes inside the GEMM and the
layer returns no bias: the same sum (bias before dropout, as bias-dropout-add adds it), one
addmm instead of an mm and an add forward, and no separate bias-gradient reduction backward.
"""
from __future__ import annotations

import functools

import torch.nn.functional as F
from megatron.core import parallel_state

SITE = "megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce"
ROW_FORWARD = "megatron.core.tensor_parallel.layers.RowParallelLinear.forward"


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


def _tp_size(layer) -> int:
    group = getattr(layer, "tp_group", None)       # core >= 0.13 keeps the layer's group
    return parallel_state.get_tensor_model_parallel_world_size() if group is None else group.size()


def bias_folds(layer) -> bool:
    """A row-parallel layer whose output needs no reduction and whose GEMM needs no Megatron Function:
    one TP rank, no expert or sequence-parallel communication, trained weight, no fusion or offload."""
    return (layer.bias is not None and layer.input_is_parallel and not layer.explicit_expert_comm
            and not layer.sequence_parallel and layer.weight.requires_grad
            and not layer.gradient_accumulation_fusion and layer.config._cpu_offloading_context is None
            and _tp_size(layer) == 1)


def _wrap_row_forward(original):
    def forward(self, input_):
        if not bias_folds(self):
            return original(self, input_)
        return F.linear(input_, self.weight, self.bias), None
    return functools.update_wrapper(forward, original)


def apply_native_linear(patcher) -> None:
    import megatron.core.tensor_parallel.layers  # noqa: F401  (the site's module)
    patcher.wrap(SITE, _wrap_linear, reason="a linear with no communication or fusion runs as torch's F.linear",
                 aliases="megatron")
    patcher.wrap(ROW_FORWARD, _wrap_row_forward, reason="a row-parallel linear over one rank adds its bias in the GEMM")
