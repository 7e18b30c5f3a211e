"""Upstream's `mindspeed.ops.npu_rotary_position_embedding` module: rotary position embedding on
the tensors' own backend.

    from mindspeed.ops.npu_rotary_position_embedding import npu_rotary_position_embedding
"""
from __future__ import annotations

from mindspeed.backends import backend_for

__all__ = ["npu_rotary_position_embedding"]


def npu_rotary_position_embedding(x, cos, sin, mode: int = 0):
    """x * cos + rotate(x) * sin -> y shaped like x. mode 0 rotates halves (GPT-NeoX), 1 interleaved
    pairs (GPT-J); cos / sin broadcast against x (BNSD, BSND or SBND); the first cos.shape[-1]
    channels rotate, the rest pass through. Differentiable in x, cos and sin."""
    return backend_for(x).kernels.rope(x, cos, sin, mode)
