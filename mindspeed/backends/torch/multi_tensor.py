"""Megatron-Core's multi-tensor gradient ops (grad-norm, clip scaling, master-to-model copies) as
torch foreach calls where neither Apex nor Transformer Engine provides them.

Megatron's own fallback (`megatron.core.utils.local_multi_tensor_*`) turns every per-tensor norm
into a Python float and back, and allocates a scaled copy of each gradient before copying it into
place: per step that is hundreds of small calls in Python. The foreach versions do the same
arithmetic (the same norms, the same products), so training is unchanged bit for bit.
"""
from __future__ import annotations

import torch

from mindspeed.patching import resolve

# (module, attribute) pairs that bind Megatron's fallbacks when Apex / TE are absent
_L2_NORM_SITES = ("megatron.core.optimizer.clip_grads.l2_norm_impl",)
_SCALE_SITES = ("megatron.core.optimizer.clip_grads.multi_tensor_scale_impl",
                "megatron.core.optimizer.optimizer.multi_tensor_scale_impl")


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract: -> (the l2 norm of all tensors as a 1-element fp32
    tensor, None)."""
    norms = [norm for tensors in tensor_lists if tensors for norm in torch._foreach_norm(tensors)]
    if not norms:
        return torch.zeros(1, dtype=torch.float), None
    return torch.linalg.vector_norm(torch.stack(norms)).to(torch.float).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract: targets[i] = sources[i] * scale."""
    sources, targets = tensor_lists[0], tensor_lists[1]
    if not targets:
        return
    if all(source is target and target.dtype == torch.float32 for source, target in zip(sources, targets)):
        torch._foreach_mul_(targets, scale)     # in place rounds bf16 differently: fp32 only
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


def apply_foreach_multi_tensor(patcher) -> None:
    """Rebind each site that holds Megatron's Python fallback; Apex's or TE's kernels stay."""
    import megatron.core.optimizer  # noqa: F401  (binds the sites below)
    from megatron.core import utils
    for sites, fallback, replacement in ((_L2_NORM_SITES, utils.local_multi_tensor_l2_norm, foreach_l2_norm),
                                         (_SCALE_SITES, utils.local_multi_tensor_scale, foreach_scale)):
        for site in sites:
            if _current(site) is fallback:
                patcher.replace(site, replacement, reason="Megatron's Apex/TE-less multi-tensor op as torch foreach")


def _current(site: str):
    owner, attr = resolve(site)
    return getattr(owner, attr, None)
