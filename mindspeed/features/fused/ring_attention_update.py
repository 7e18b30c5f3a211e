"""--use-fused-ring-attention-update: ring attention merges partial results with the backend's
fused ring_attention_update (npu_ring_attention_update) instead of the reference merge.

No Megatron hook: the ring attention code (features/context_parallel) asks `merge_function()`.
"""
from __future__ import annotations

from mindspeed.backends import get_backend

_state = {"fused": False}   # replaced (not mutated) by install, so remove_all restores it


def merge_function():
    """The ring_attention_update to use: the fused kernel when the flag is on, else the reference."""
    kernels = get_backend().kernels
    return kernels.ring_attention_update if _state["fused"] else kernels.reference.ring_attention_update




def install(patcher, args) -> None:
    patcher.replace(f"{__name__}._state", {"fused": True}, reason="--use-fused-ring-attention-update")
