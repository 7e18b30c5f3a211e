"""Megatron-Core's CLIP vision encoder (CLIPViTModel, LLaVA's vision tower) without Transformer Engine.

Without TE, CLIPViTModel's default pre/post norm is `torch.nn.LayerNorm`, which it builds through
Megatron's `build_module(impl, config=..., hidden_size=..., eps=...)`: torch's LayerNorm takes no
`config`, so every CLIP and LLaVA model fails to build on a machine without TE (Megatron's own
fallback, any device). With TE the default is TENorm, which builds the config's LayerNorm or RMSNorm
from (config, hidden_size, eps): that is what Megatron's WrappedTorchNorm does from torch's norms,
so the stand-in takes torch.nn.LayerNorm's place wherever CLIPViTModel is asked to build it.
"""
from __future__ import annotations

import functools
import inspect

import torch

CLIP_MODULE = "megatron.core.models.vision.clip_vit_model"
NORM_ARGUMENTS = ("ln_pre_impl", "ln_post_impl")


def _wrap_clip_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        for name in NORM_ARGUMENTS:
            if bound.arguments.get(name) is torch.nn.LayerNorm:   # cannot take build_module's config
                bound.arguments[name] = WrappedTorchNorm
        return original(*bound.args, **bound.kwargs)
    return __init__


def apply_clip_vit_norm(patcher) -> bool:
    """CLIPViTModel's torch.nn.LayerNorm (its default without TE) built as the config's norm; True if
    applied (not when Transformer Engine gave CLIP its TENorm default)."""
    import importlib
    clip = importlib.import_module(CLIP_MODULE)
    if clip.NORM_IMPL is not torch.nn.LayerNorm:
        return False
    patcher.wrap(f"{CLIP_MODULE}.CLIPViTModel.__init__", _wrap_clip_init,
                 reason="Transformer Engine absent: CLIP's default torch.nn.LayerNorm cannot take Megatron's "
                 "config; the config's norm (WrappedTorchNorm, what TENorm builds) instead")
    return True
