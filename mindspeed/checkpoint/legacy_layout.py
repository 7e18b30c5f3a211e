"""How Megatron-Core's local-spec GPT splits its tensors over the ranks of a legacy (--ckpt-format torch)
checkpoint, whose per-rank files hold each rank's own parameters under the model's names: layers
numbered within their pipeline stage, experts within their expert-parallel rank, tensors cut for their
tensor-parallel rank. The converter reads (legacy_read) and writes (convert.legacy_write) that layout
with these rules.

- Column-parallel linears (q/k/v, fc1, the embedding, the output layer, multi-latent attention's
  projections, MTP's eh_proj) are cut along their rows, row-parallel ones (the attention's output
  projection, fc2) along their columns; everything else (norms, routers) is whole on every rank.
- SwiGLU's fc1 is [gate; up] on every rank: its TP cuts take a slice of each half.
- GroupedMLP (--moe-grouped-gemm) keeps a rank's E experts in two tensors whose memory is, expert after
  expert, each one's transposed weights (its forward views them so): weight1 [hidden, E * fc1 rows] is
  [E, hidden, fc1 rows] viewed flat, weight2 [E * ffn, hidden] is [E, ffn, hidden].
"""
from __future__ import annotations

import torch

COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight",
          "output_layer.weight", "linear_q_proj.weight", "linear_q_down_proj.weight", "linear_q_up_proj.weight",
          "linear_kv_down_proj.weight", "linear_kv_up_proj.weight", "eh_proj.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")
LOCAL_EXPERTS = "mlp.experts.local_experts."
GROUPED = ("mlp.experts.weight1", "mlp.experts.weight2")


def tp_axis(name: str) -> int | None:
    """The axis `name` is cut along over the tensor-parallel ranks; None: whole on each."""
    if name.endswith(COLUMN):
        return 0
    if name.endswith(ROW):
        return 1
    return None


def _gated(name: str) -> bool:
    return name.endswith("linear_fc1.weight")     # every MLP the converter knows is SwiGLU


def tp_slice(name: str, whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s part of the whole tensor `name`."""
    axis = tp_axis(name)
    if axis is None or size == 1:
        return whole
    if _gated(name):
        return torch.cat([half.chunk(size)[rank] for half in whole.chunk(2)])
    return whole.chunk(size, dim=axis)[rank].contiguous()


def tp_merge(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of tp_slice: the whole tensor from every rank's part, in rank order."""
    axis = tp_axis(name)
    if axis is None or len(parts) == 1:
        return parts[0]
    if _gated(name):
        halves = [p.chunk(2) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=axis)


def tp_merged_shape(name: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    axis = tp_axis(name)
    if axis is None:
        return shapes[0]
    merged = list(shapes[0])
    merged[axis] = sum(s[axis] for s in shapes)
    return tuple(merged)


def group_experts(fc1: list[torch.Tensor], fc2: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's experts' fc1 [rows, hidden] and fc2 [hidden, ffn] parts -> GroupedMLP's weight1, weight2."""
    weight1 = torch.stack([w.t() for w in fc1])
    return weight1.reshape(weight1.shape[1], -1), torch.cat([w.t() for w in fc2]).contiguous()


def grouped_expert(weight1: torch.Tensor, weight2: torch.Tensor, experts: int, k: int):
    """The inverse of group_experts for local expert k: its (fc1, fc2) parts, as views of the two tensors."""
    hidden = weight1.shape[0]
    return weight1.reshape(experts, hidden, -1)[k].t(), weight2.reshape(experts, -1, hidden)[k].t()
