"""--use-fused-swiglu: Megatron-Core's SwiGLU MLP calls kernels.swiglu.

Hook: Megatron's MLP takes its fused path (`bias_swiglu_impl`) when the config field
bias_activation_fusion is on; the feature turns that field on for SiLU-GLU models and supplies
the implementation.
"""
from __future__ import annotations

import torch.nn.functional as F

from mindspeed.backends import get_backend
from mindspeed.features.fused import config_fields


def fused_bias_swiglu(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """Megatron's bias_swiglu_impl signature: swiglu(input + bias) along the last dim."""
    x = input if bias is None else input + bias
    return get_backend().kernels.swiglu(x, -1)


def _silu_glu(config):
    return True if (config.gated_linear_unit and config.activation_func is F.silu
                    and not getattr(config, "use_te_activation_func", False)) else None   # field new in core 0.13


def install(ctx, args) -> None:
    patcher = ctx.patcher
    why = "--use-fused-swiglu"
    config_fields.override(patcher, "bias_activation_fusion", _silu_glu, why)
    patcher.replace("megatron.core.transformer.mlp.bias_swiglu_impl", fused_bias_swiglu, reason=why)
