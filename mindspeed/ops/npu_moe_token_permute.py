"""Upstream's `mindspeed.ops.npu_moe_token_permute` module: MoE token permutation from top-k expert
indices, on the tensors' own backend.

    from mindspeed.ops.npu_moe_token_permute import npu_moe_token_permute
    permuted, sorted_indices = npu_moe_token_permute(tokens, indices)     # indices [T, topk]

`mindspeed.ops.npu_moe_token_permute` itself (the flat op) takes a [T, E] routing map.
"""
from __future__ import annotations

__all__ = ["npu_moe_token_permute"]


def npu_moe_token_permute(tokens, indices, num_out_tokens: int | None = None, padded_mode: bool = False):
    """-> (permuted_tokens, sorted_indices).

    tokens [T, H]; indices [T, topk] (or [T] for top-1) integer expert ids. Every (token, k) slot
    becomes one row of permuted_tokens, ordered by expert and, within an expert, by slot t * topk + k.
    num_out_tokens keeps the first rows only (capacity dropping): None or 0 keeps all, a negative
    value drops that many. sorted_indices (int32, [T * topk]) gives each slot's row in
    permuted_tokens (rows past num_out_tokens were dropped): npu_moe_token_unpermute takes it back.
    padded_mode (indices as [E, capacity]) is not supported, as upstream."""
    if padded_mode:
        raise ValueError("npu_moe_token_permute: padded_mode is not supported; pass indices [T, topk]")
    if tokens.ndim != 2 or indices.ndim not in (1, 2) or indices.shape[0] != tokens.shape[0]:
        raise ValueError(f"npu_moe_token_permute: expected tokens [T, H] and indices [T] or [T, topk], got "
                         f"{tuple(tokens.shape)} and {tuple(indices.shape)}")
    topk = 1 if indices.ndim == 1 else indices.shape[1]
    slots = indices.reshape(-1)
    order = expert_major_order(slots)                   # slot of each permuted row
    kept = kept_rows(num_out_tokens, slots.shape[0])
    # indexing is differentiable on both frameworks (a gather, its gradient a scatter-add)
    permuted = tokens[order[:kept] // topk]
    return permuted, order.argsort().int()


def expert_major_order(slots):
    """The stable argsort of the experts in `slots`: sort keys expert * n + slot are distinct, so an
    unstable argsort (MindSpore's) gives the stable order."""
    n = slots.shape[0]
    position = (slots * 0 + 1).cumsum(0) - 1           # 0..n-1 in slots' framework, device and dtype
    return (slots * n + position).argsort()


def kept_rows(num_out_tokens, num_slots: int) -> int:
    if num_out_tokens is None or num_out_tokens == 0:
        return num_slots
    kept = num_out_tokens if num_out_tokens > 0 else num_slots + num_out_tokens
    if not 0 <= kept:
        raise ValueError(f"npu_moe_token_permute: num_out_tokens {num_out_tokens} drops more than the "
                         f"{num_slots} routed slots")
    return min(kept, num_slots)
