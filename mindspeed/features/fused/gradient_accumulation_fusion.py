"""--gradient-accumulation-fusion: Megatron's linear layers add their weight gradient straight
into the fp32 main_grad with kernels.matmul_add_fp32 (npu_matmul_add_fp32), no separate wgrad.

Hook: Megatron-Core looks for the CUDA extension `fused_weight_gradient_mlp_cuda` in
tensor_parallel.layers; the feature supplies one backed by the kernel and turns the config field
gradient_accumulation_fusion on. Needs Megatron's DDP (it owns main_grad).
"""
from __future__ import annotations

from mindspeed.features.fused import config_fields

LAYERS = "megatron.core.tensor_parallel.layers"


class WgradAccumulation:
    """The two entry points Megatron calls: main_grad += grad_output^T @ total_input (the fp32 one with
    the run's kernels)."""

    def __init__(self, kernels):
        self.kernels = kernels

    def wgrad_gemm_accum_fp32(self, total_input, grad_output, main_grad):
        self.kernels.matmul_add_fp32(total_input, grad_output, main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
        x = total_input.reshape(-1, total_input.shape[-1])
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        main_grad.addmm_(dy.t().to(main_grad.dtype), x.to(main_grad.dtype))


def install(ctx, args) -> None:
    patcher = ctx.patcher
    import importlib
    layers = importlib.import_module(LAYERS)
    why = "--gradient-accumulation-fusion via kernels.matmul_add_fp32"
    wgrad = WgradAccumulation(ctx.backend.kernels)
    if hasattr(layers, "fused_weight_gradient_mlp_cuda"):
        patcher.replace(f"{LAYERS}.fused_weight_gradient_mlp_cuda", wgrad, reason=why)
    else:   # Megatron leaves the name unbound when the CUDA extension is missing
        patcher.define(f"{LAYERS}.fused_weight_gradient_mlp_cuda", wgrad, reason=why)
    patcher.replace(f"{LAYERS}._grad_accum_fusion_available", True, reason=why)
    config_fields.override(patcher, "gradient_accumulation_fusion", lambda config: True, why)
