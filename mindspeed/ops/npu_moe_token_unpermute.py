"""Upstream's `mindspeed.ops.npu_moe_token_unpermute` module: the inverse of npu_moe_token_permute,
merging each token's expert outputs weighted by its routing probabilities.

    from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute
    tokens = npu_moe_token_unpermute(permuted, sorted_indices, probs)     # probs [T, topk]

`mindspeed.ops.npu_moe_token_unpermute` itself (the flat op) takes Megatron's sorted indices.
"""
from __future__ import annotations

from mindspeed.backends import backend_for

__all__ = ["npu_moe_token_unpermute"]


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode: bool = False,
                            restore_shape=None):
    """-> unpermuted_tokens [T, H]: token t = sum over k of probs[t, k] * permuted_tokens[row of slot
    t * topk + k], with sorted_indices ([T * topk], each slot's row) as npu_moe_token_permute returns
    it; slots whose row was dropped add nothing. Without probs each slot is a token (topk 1, weight
    1). restore_shape is used only by padded_mode, which is not supported, as upstream."""
    if padded_mode:
        raise ValueError("npu_moe_token_unpermute: padded_mode is not supported; pass the sorted_indices "
                         "of npu_moe_token_permute")
    num_slots = sorted_indices.shape[0]
    if permuted_tokens.ndim != 2 or sorted_indices.ndim != 1 or permuted_tokens.shape[0] > num_slots:
        raise ValueError(f"npu_moe_token_unpermute: expected permuted_tokens [P, H] and sorted_indices [S] with "
                         f"P <= S, got {tuple(permuted_tokens.shape)} and {tuple(sorted_indices.shape)}")
    if probs is not None and (probs.ndim != 2 or probs.shape[0] * probs.shape[1] != num_slots):
        raise ValueError(f"npu_moe_token_unpermute: probs must be [T, topk] with T * topk = {num_slots} slots, "
                         f"got {tuple(probs.shape)}")
    topk = 1 if probs is None else probs.shape[1]
    rows = permuted_tokens.shape[0]
    slot_of_row = sorted_indices.argsort()[:rows]       # a permutation: its argsort is its inverse
    weights = None if probs is None else probs.reshape(-1)[slot_of_row]
    return backend_for(permuted_tokens).kernels.moe_unpermute(
        permuted_tokens, slot_of_row // topk, weights, (num_slots // topk, permuted_tokens.shape[1]))
