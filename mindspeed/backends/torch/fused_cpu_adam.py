"""Megatron-Core's Adam on the cpu as torch's fused Adam kernel.

Without Transformer Engine or Apex, Megatron-Core builds torch.optim.AdamW (or Adam) with neither
`fused` nor `foreach`; for cpu tensors torch then takes its single-tensor path: a Python loop of
about ten dispatched ops per parameter per step. torch's fused cpu kernel does the same update per
element in one call per parameter group (docs/performance.md has the measured step times). The
update is the same; its results differ from the single-tensor path's only in fp32 rounding.

Each Megatron optimizer wrapper gets a step pre-hook on its inner torch optimizer that turns the
groups' `fused` on before every step where the kernel applies (cpu floating-point parameters, not
differentiable or capturable): Megatron's distributed optimizer rebuilds the groups after
construction and load_state_dict brings back the groups a checkpoint saved, so a flag set once
could be lost.
"""
from __future__ import annotations

import functools

import torch

SITE = "megatron.core.optimizer.optimizer.MegatronOptimizer.__init__"


def fused_kernel_applies(optimizer) -> bool:
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return bool(params) and all(p.device.type == "cpu" and p.is_floating_point() for p in params) \
        and not any(group.get("differentiable") or group.get("capturable") for group in optimizer.param_groups)


def use_fused_kernel(optimizer, args=None, kwargs=None) -> None:
    """A step pre-hook: the groups take torch's fused kernel where it applies. Once they have it,
    a step costs one look at the groups, not a walk over every parameter."""
    if all(group.get("fused") for group in optimizer.param_groups):
        return
    if fused_kernel_applies(optimizer):
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, False


def _wrap_init(original):
    def __init__(self, optimizer, *args, **kwargs):
        original(self, optimizer, *args, **kwargs)
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer.register_step_pre_hook(use_fused_kernel)
    return functools.update_wrapper(__init__, original)


def apply_fused_cpu_adam(patcher) -> None:
    import megatron.core.optimizer.optimizer  # noqa: F401  (the site's module)
    patcher.wrap(SITE, _wrap_init, reason="Megatron's Adam on the cpu runs torch's fused kernel")
