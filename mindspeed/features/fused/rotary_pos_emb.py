"""--use-fused-rotary-pos-emb: Megatron-Core's RoPE calls kernels.rope.

Hook: attention's `apply_rotary_pos_emb` (sbhd layout; packed THD sequences and MLA keep
Megatron's own path). cos/sin are computed in fp32 from Megatron's freqs, mode 1 when
config.rotary_interleaved.
"""
from __future__ import annotations

import torch

TARGET = "megatron.core.transformer.attention.apply_rotary_pos_emb"


def _make_fused(original, kernels):
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
        if cu_seqlens is not None or config.multi_latent_attention:
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        freqs = freqs.float()
        cos, sin = torch.cos(freqs) * mscale, torch.sin(freqs) * mscale
        return kernels.rope(t, cos, sin, 1 if config.rotary_interleaved else 0)
    return apply_rotary_pos_emb


def install(ctx, args) -> None:
    kernels = ctx.backend.kernels
    ctx.patcher.wrap(TARGET, lambda original: _make_fused(original, kernels), reason="--use-fused-rotary-pos-emb")
