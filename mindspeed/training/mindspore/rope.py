"""Rotary position embedding's cos/sin tables for the MindSpore GPT (Megatron-Core's
RotaryEmbedding, rotate-half layout), optionally with Llama 3.1's frequency scaling
(--use-rope-scaling) or YaRN's (Megatron-Core's YarnRotaryEmbedding), and the rows a sequence (or a
context-parallel shard of it) reads."""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import ops


def rope_tables(kv_channels: int, rotary_percent: float, rotary_base: float, seq_length: int,
                scaling_factor: float | None = None, yarn: dict | None = None) -> tuple:
    """(cos, sin) tensors [s, 1, 1, dim] over the rotated share of each head (dim = kv_channels x
    rotary_percent; with YaRN the whole head, as YarnRotaryEmbedding) for positions 0..seq_length-1;
    YaRN's tables are times its concentration factor (Megatron-Core scales q and k by it in their rotation)."""
    dim = kv_channels if yarn else int(kv_channels * rotary_percent)
    inv_freq = 1.0 / (rotary_base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if scaling_factor is not None:
        inv_freq = llama3_scaled_inv_freq(inv_freq, scaling_factor)
    concentration = 1.0
    if yarn:
        inv_freq, concentration = yarn_inv_freq(dim, rotary_base, **yarn)
    freqs = np.outer(np.arange(seq_length, dtype=np.float32), inv_freq)
    emb = np.concatenate([freqs, freqs], -1)[:, None, None, :]        # [s, 1, 1, dim], rotate-half
    return ms.Tensor(np.cos(emb) * np.float32(concentration)), ms.Tensor(np.sin(emb) * np.float32(concentration))


def yarn_inv_freq(dim: int, rotary_base: float, rotary_scaling_factor: float, original_max_position_embeddings: int,
                  beta_fast: float, beta_slow: float, mscale: float, mscale_all_dim: float) -> tuple:
    """YaRN's frequencies and concentration factor as Megatron-Core 0.16's YarnRotaryEmbedding computes them:
    each frequency blended between the original (extrapolated) and the one slowed by the factor (interpolated)
    by a linear ramp over the dimensions between the beta_fast and beta_slow rotation counts of the original
    context; the factor (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1) multiplies cos and sin."""
    f32 = np.float32
    powers = rotary_base ** (np.arange(0, dim, 2, dtype=f32) / f32(dim))
    extra, inter = f32(1) / powers, f32(1) / (f32(rotary_scaling_factor) * powers)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rotary_base))
    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001           # Megatron's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
    keep = f32(1) - ramp
    inv_freq = (inter * (f32(1) - keep) + extra * keep).astype(f32)

    def get_mscale(m: float) -> float:
        return 1.0 if rotary_scaling_factor <= 1 else 0.1 * m * math.log(rotary_scaling_factor) + 1.0
    return inv_freq, get_mscale(mscale) / get_mscale(mscale_all_dim)


def rows_at(cos, sin, s: int, positions=None) -> tuple:
    """The tables' rows for a sequence of s tokens: the first s, or `positions` [s] (this context-
    parallel rank's share of the sequence)."""
    if positions is None:
        return cos[:s], sin[:s]
    return ops.gather(cos, positions, 0), ops.gather(sin, positions, 0)


def llama3_scaled_inv_freq(inv_freq: np.ndarray, factor: float, low_freq_factor: float = 1.0,
                           high_freq_factor: float = 4.0, old_context_len: int = 8192) -> np.ndarray:
    """Llama 3.1's RoPE frequency scaling, step for step as Megatron-Core 0.16's
    RotaryEmbedding._apply_scaling computes it in fp32 (only `factor` is a flag there): long
    wavelengths are slowed by `factor`, short ones kept, the band between interpolated."""
    f32 = np.float32
    freqs = inv_freq.astype(f32)
    low_wavelen, high_wavelen = f32(old_context_len / low_freq_factor), f32(old_context_len / high_freq_factor)
    # torch evaluates `scalar / tensor` as reciprocal(tensor) * scalar: the same here, bit for bit
    wavelen = (f32(1) / freqs) * f32(2 * math.pi)
    scaled = np.where(wavelen > low_wavelen, freqs / f32(factor), freqs)
    smooth = ((f32(1) / wavelen) * f32(old_context_len) - f32(low_freq_factor)) / f32(high_freq_factor - low_freq_factor)
    smoothed = (f32(1) - smooth) * scaled / f32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)
