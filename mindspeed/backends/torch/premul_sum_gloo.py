"""Megatron-FSDP's gradient scaling where gloo stands in for NCCL.

With `gradient_reduce_div_fusion` (its default) Megatron-FSDP reduces gradients with NCCL's
PREMUL_SUM (each rank's gradient times the scaling factor, then the sum), which gloo refuses
("Cannot use ReduceOp.PREMUL_SUM with Gloo"). Megatron's own other branch scales the gradient in
place, then sums: the same products and the same sum, so that branch is taken.
"""
from __future__ import annotations

import copy
import importlib.util

MODULE = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
SITE = f"{MODULE}.gradient_reduce_preprocessing"


def _wrap_preprocessing(original):
    def gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config):
        if scaling_factor is not None and getattr(ddp_config, "gradient_reduce_div_fusion", False):
            ddp_config = copy.copy(ddp_config)
            ddp_config.gradient_reduce_div_fusion = False   # scale in place, then ReduceOp.SUM
        return original(grad_data, scaling_factor, ddp_config)
    return gradient_reduce_preprocessing


def apply_premul_sum_on_gloo(patcher) -> None:
    try:
        present = importlib.util.find_spec(MODULE) is not None
    except ModuleNotFoundError:     # a core without Megatron-FSDP (core_v0.12)
        present = False
    if present:
        patcher.wrap(SITE, _wrap_preprocessing,
                     reason="gloo has no PREMUL_SUM: Megatron-FSDP's gradients scaled in place, then summed")
