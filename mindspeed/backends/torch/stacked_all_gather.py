"""all_gather_into_tensor into a stacked output ([world, *input.shape]) on gloo.

torch documents two output forms for all_gather_into_tensor: the inputs concatenated along their
first dimension, or stacked along a new one; NCCL takes both, gloo only the first. The two forms
hold the same elements in the same order, so a contiguous stacked output is handed to gloo as its
concatenated view (Megatron's MoE tests gather their inputs that way).
"""
from __future__ import annotations

SITE = "torch.distributed.all_gather_into_tensor"


def _stacked(output_tensor, input_tensor) -> bool:
    return output_tensor.dim() == input_tensor.dim() + 1 and output_tensor.shape[1:] == input_tensor.shape \
        and output_tensor.is_contiguous()


def _wrap_all_gather_into_tensor(original):
    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if _stacked(output_tensor, input_tensor):
            output_tensor = output_tensor.view(-1, *input_tensor.shape[1:])
        return original(output_tensor, input_tensor, group, async_op)
    return all_gather_into_tensor


def apply_stacked_all_gather(patcher) -> None:
    patcher.wrap(SITE, _wrap_all_gather_into_tensor,
                 reason="gloo takes only the concatenated output form: a stacked one goes as its flat view",
                 aliases="torch.distributed")
