"""--moe-grouped-gemm (+ --gemm-gradient-accumulation-fusion): Megatron-Core's GroupedMLP runs its
expert GEMMs through kernels.gmm (npu_gmm) instead of the CUDA `grouped_gemm` package.

Hooks: grouped_gemm_util's package handle (GroupedMLP calls `gg.ops.gmm(x, w, sizes,
trans_b)`), the spec provider's expert choice (GroupedMLP, no per-expert MLPs) and the config
field moe_grouped_gemm. With --gemm-gradient-accumulation-fusion the weight gradient goes
straight into the expert weight's fp32 main_grad (Megatron's DDP), like the linear layers' fusion.
"""
from __future__ import annotations

import torch

from mindspeed.features.fused import config_fields
from mindspeed.features.fused.megatron_specs import LOCAL_SPEC_PROVIDER, SPEC_GROUPED_EXPERTS, has_local_spec_provider

GG = "megatron.core.transformer.moe.grouped_gemm_util"


class _GmmIntoMainGrad(torch.autograd.Function):
    """gmm whose weight gradient is added to `param.main_grad` (param: the weight's base Parameter)."""

    @staticmethod
    def forward(ctx, x, weight, sizes, param, kernels):
        ctx.save_for_backward(x, weight)
        ctx.sizes, ctx.param, ctx.kernels = sizes, param, kernels
        with torch.no_grad():
            return kernels.gmm(x, weight, sizes, 1)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        kernels = ctx.kernels
        dx = kernels.gmm(dy, weight.transpose(1, 2), ctx.sizes, 1)
        main_grad = ctx.param.main_grad.view(weight.shape)
        start = 0
        for g, rows in enumerate(ctx.sizes):
            rows = int(rows)
            if rows:
                x_g, dy_g = x[start:start + rows], dy[start:start + rows]
                if main_grad.dtype == torch.float32:
                    kernels.matmul_add_fp32(dy_g, x_g, main_grad[g])    # main_grad[g] += x_g^T dy_g
                else:
                    main_grad[g].add_(x_g.t().to(main_grad.dtype) @ dy_g.to(main_grad.dtype))
            start += rows
        if hasattr(ctx.param, "grad_added_to_main_grad"):
            ctx.param.grad_added_to_main_grad = True
        return dx, torch.zeros_like(weight), None, None, None   # dummy grad keeps DDP's hooks firing


class GroupedGemmOps:
    """Stands in for the `grouped_gemm` package: .ops.gmm(a, b, batch_sizes, trans_b), with the run's kernels."""

    def __init__(self, into_main_grad: bool, kernels):
        self.into_main_grad, self.kernels = into_main_grad, kernels
        self.ops = self

    def gmm(self, a, b, batch_sizes, trans_b: bool = False):
        weight = b.transpose(1, 2) if trans_b else b
        sizes = [int(s) for s in batch_sizes.tolist()] if torch.is_tensor(batch_sizes) else list(batch_sizes)
        param = b._base if b._base is not None else b
        if self.into_main_grad and getattr(param, "main_grad", None) is not None and torch.is_grad_enabled():
            return _GmmIntoMainGrad.apply(a, weight, sizes, param, self.kernels)
        return self.kernels.gmm(a, weight, sizes, 1)


def _grouped_mlp_modules(original):
    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        return original(self, True, True)
    return grouped_mlp_modules


def provide_grouped_gemm_package(ctx, into_main_grad: bool, why: str) -> None:
    """Megatron's `grouped_gemm` package handle served by the backend's gmm: GroupedMLP builds and
    runs wherever it would with the CUDA package (Megatron's own unit tests build it directly)."""
    ops = GroupedGemmOps(into_main_grad, ctx.backend.kernels)
    ctx.patcher.replace(f"{GG}.grouped_gemm", ops, reason=why)
    ctx.patcher.replace(f"{GG}.ops", ops, reason=why)


def install(ctx, args) -> None:
    why = "--moe-grouped-gemm via kernels.gmm"
    patcher = ctx.patcher
    provide_grouped_gemm_package(ctx, args.gemm_gradient_accumulation_fusion, why)
    ctx.provide(SPEC_GROUPED_EXPERTS, True)
    if has_local_spec_provider() and not ctx.specs_from_session:   # core 0.12's local spec picks GroupedMLP from the flag itself
        patcher.wrap(f"{LOCAL_SPEC_PROVIDER}.grouped_mlp_modules", _grouped_mlp_modules, reason=why)
    config_fields.override(patcher, "moe_grouped_gemm", lambda config: True, why)
