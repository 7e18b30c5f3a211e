"""--use-fused-moe-token-permute-and-unpermute: Megatron-Core's MoE token dispatchers permute
and unpermute tokens with kernels.moe_permute / moe_unpermute (npu_moe_token_permute...).

Hook: the `permute` / `unpermute` names the dispatchers import from moe_utils. Capacity-padded
routing (drop_and_pad) and token dropping keep Megatron's own path.
"""
from __future__ import annotations

DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


def _make_permute(original, kernels):
    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
        routed = int(routing_map.sum()) if num_out_tokens is not None else None
        if drop_and_pad or (num_out_tokens is not None and num_out_tokens != routed):
            return original(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                            drop_and_pad=drop_and_pad)
        permuted, sorted_indices = kernels.moe_permute(tokens, routing_map)
        permuted_probs = None
        if probs is not None:   # same expert-major order as the rows
            permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
        return permuted, permuted_probs, sorted_indices
    return permute


def _make_unpermute(original, kernels):
    def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
                  drop_and_pad=False):
        if drop_and_pad:
            return original(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                            fused=fused, drop_and_pad=drop_and_pad)
        return kernels.moe_unpermute(permuted_tokens, sorted_indices, probs, restore_shape, routing_map=routing_map)
    return unpermute


def install(ctx, args) -> None:
    patcher, kernels = ctx.patcher, ctx.backend.kernels
    why = "--use-fused-moe-token-permute-and-unpermute"
    patcher.wrap(f"{DISPATCHER}.permute", lambda original: _make_permute(original, kernels), reason=why)
    patcher.wrap(f"{DISPATCHER}.unpermute", lambda original: _make_unpermute(original, kernels), reason=why)
