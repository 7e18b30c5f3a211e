"""--use-fused-swiglu: Megatron-Core's SwiGLU MLP calls kernels.swiglu.

Hook: Megatron's MLP takes its fused path (`bias_swiglu_impl`) when the config field
bias_activation_fusion is on; the feature turns that field on for SiLU-GLU models and supplies
the implementation.
"""
from __future__ import annotations

import torch.nn.functional as F

from mindspeed.features.fused import config_fields


def fused_bias_swiglu(kernels):
    """Megatron's bias_swiglu_impl with the run's kernels: swiglu(input + bias) along the last dim."""
    def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
        x = input if bias is None else input + bias
        return kernels.swiglu(x, -1)
    return bias_swiglu_impl


def _silu_glu(config):
    return True if (config.gated_linear_unit and config.activation_func is F.silu
                    and not getattr(config, "use_te_activation_func", False)) else None   # field new in core 0.13


def install(ctx, args) -> None:
    patcher = ctx.patcher
    why = "--use-fused-swiglu"
    config_fields.override(patcher, "bias_activation_fusion", _silu_glu, why)
    patcher.replace("megatron.core.transformer.mlp.bias_swiglu_impl", fused_bias_swiglu(ctx.backend.kernels),
                    reason=why)
