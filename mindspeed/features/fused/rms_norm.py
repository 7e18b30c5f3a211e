"""--use-fused-rmsnorm: Megatron-Core's RMSNorm layers call kernels.rms_norm.

Hook: the local spec's norm (input/pre-MLP/qk norms; see megatron_specs.py) and the block's
final-norm class both become FusedNorm, a factory like Megatron's WrappedTorchNorm that builds
FusedRMSNorm for RMSNorm configs and defers to Megatron's own norm otherwise.
"""
from __future__ import annotations

import torch

from mindspeed.backends import get_backend
from mindspeed.features.fused.megatron_specs import (GPT_LAYER_SPECS, LOCAL_SPEC_PROVIDER, SPEC_NORM,
                                                     has_local_spec_provider)


class FusedRMSNorm(torch.nn.Module):
    """RMSNorm with the same parameter name (`weight`) as torch.nn.RMSNorm, so checkpoints match."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=params_dtype))
        setattr(self.weight, "sequence_parallel", sequence_parallel)   # Megatron's grad all-reduce tag

    def forward(self, x):
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return get_backend().kernels.rms_norm(x, weight, self.eps)[0]


class FusedNorm:
    """Factory with Megatron's norm signature (config, hidden_size, eps)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5):
        if config.normalization == "RMSNorm" and not config.layernorm_zero_centered_gamma:
            return FusedRMSNorm(hidden_size, eps, config.sequence_parallel, config.params_dtype)
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        return WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=eps)


def _layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
    return FusedNorm


def install(ctx, args) -> None:
    ctx.provide(SPEC_NORM, FusedNorm)
    if not ctx.specs_from_session:
        _patch_specs(ctx.patcher)


def _patch_specs(patcher) -> None:
    why = "--use-fused-rmsnorm"
    if has_local_spec_provider():
        patcher.replace(f"{LOCAL_SPEC_PROVIDER}.layer_norm", _layer_norm, reason=why)
    else:   # core 0.12: RMSNorm configs rebind LNImpl to WrappedTorchNorm inside the spec builder
        patcher.replace(f"{GPT_LAYER_SPECS}.WrappedTorchNorm", FusedNorm, reason=why)
    # the final norm: of a block spec (mixed dense/MoE layers) and of a block built from a layer spec
    patcher.replace(f"{GPT_LAYER_SPECS}.LNImpl", FusedNorm, reason=why + " (final norm of a block spec)")
    patcher.replace("megatron.core.transformer.transformer_block.LayerNormImpl", FusedNorm,
                    reason=why + " (final norm)")
