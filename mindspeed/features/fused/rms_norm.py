"""--use-fused-rmsnorm: Megatron-Core's RMSNorm layers call kernels.rms_norm.

Hook: the local spec's norm (input/pre-MLP/qk norms; see megatron_specs.py) and the block's
final-norm class both become FusedNorm, a factory like Megatron's WrappedTorchNorm that builds
FusedRMSNorm for RMSNorm configs and defers to Megatron's own norm otherwise. Megatron builds norms
from a class, so the run's kernels reach them bound into a subclass made at apply (fused_norm).
"""
from __future__ import annotations

from typing import Any

import torch

from mindspeed.features.fused.megatron_specs import (GPT_LAYER_SPECS, LOCAL_SPEC_PROVIDER, SPEC_NORM,
                                                     has_local_spec_provider)


class FusedRMSNorm(torch.nn.Module):
    """RMSNorm with the same parameter name (`weight`) as torch.nn.RMSNorm, so checkpoints match."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype=torch.float32, *, kernels):
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=params_dtype))
        setattr(self.weight, "sequence_parallel", sequence_parallel)   # Megatron's grad all-reduce tag

    def forward(self, x):
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return self.kernels.rms_norm(x, weight, self.eps)[0]


class FusedNorm:
    """Factory with Megatron's norm signature (config, hidden_size, eps); its subclass fused_norm(kernels)
    is what a run uses."""
    kernels: Any        # set by fused_norm

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5):
        if config.normalization == "RMSNorm" and not config.layernorm_zero_centered_gamma:
            return FusedRMSNorm(hidden_size, eps, config.sequence_parallel, config.params_dtype, kernels=cls.kernels)
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        return WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=eps)


def fused_norm(kernels) -> type:
    """FusedNorm whose RMSNorms call `kernels` (the run's backend's)."""
    return type(FusedNorm.__name__, (FusedNorm,), {"kernels": kernels})


def install(ctx, args) -> None:
    norm = fused_norm(ctx.backend.kernels)
    ctx.provide(SPEC_NORM, norm)
    if not ctx.specs_from_session:
        _patch_specs(ctx.patcher, norm)


def _patch_specs(patcher, norm: type) -> None:
    why = "--use-fused-rmsnorm"
    if has_local_spec_provider():
        patcher.replace(f"{LOCAL_SPEC_PROVIDER}.layer_norm", lambda self, rms_norm=False, for_qk=False: norm,
                        reason=why)
    else:   # core 0.12: RMSNorm configs rebind LNImpl to WrappedTorchNorm inside the spec builder
        patcher.replace(f"{GPT_LAYER_SPECS}.WrappedTorchNorm", norm, reason=why)
    # the final norm: of a block spec (mixed dense/MoE layers) and of a block built from a layer spec
    patcher.replace(f"{GPT_LAYER_SPECS}.LNImpl", norm, reason=why + " (final norm of a block spec)")
    patcher.replace("megatron.core.transformer.transformer_block.LayerNormImpl", norm,
                    reason=why + " (final norm)")
