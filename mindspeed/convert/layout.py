"""Tensor layouts: Hugging Face Llama/Qwen2 names and shapes <-> Megatron-Core GPTModel (local spec).

Megatron fuses q, k and v into one `linear_qkv` whose rows are grouped by query group:
for each of the G key/value heads, that group's H/G query heads, then its k head, then its v head
(each head `head_dim` rows). TP shards are contiguous runs of whole groups, so this global layout
is the same at every tensor-parallel size. SwiGLU's `linear_fc1` is [gate; up].
Both Llama and Qwen2 keep q/k rows in the rotate-half order that Megatron's (non-interleaved) RoPE
uses, so no per-head permutation is needed.
"""
from __future__ import annotations

import torch

from mindspeed.convert.arch import Arch


def fuse_qkv(arch: Arch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[H*d(, h)], [G*d(, h)], [G*d(, h)] -> Megatron's grouped [(H+2G)*d(, h)] (weights or biases)."""
    g, d, rest = arch.num_kv_heads, arch.head_dim, q.shape[1:]
    groups = torch.cat([q.reshape(g, arch.heads_per_group * d, *rest),
                        k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return groups.reshape(-1, *rest)


def split_qkv(arch: Arch, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of fuse_qkv."""
    g, d, rest = arch.num_kv_heads, arch.head_dim, qkv.shape[1:]
    q_rows = arch.heads_per_group * d
    groups = qkv.reshape(g, q_rows + 2 * d, *rest)
    q, k, v = groups.split([q_rows, d, d], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def fit_vocab(weight: torch.Tensor, keep_rows: int, rows: int) -> torch.Tensor:
    """Embedding/output rows: the first `keep_rows` kept, then zeros up to `rows` (Megatron's padded
    vocabulary one way, the Hugging Face config's vocab_size the other)."""
    kept = weight[:keep_rows]
    if kept.shape[0] == rows:
        return kept
    return torch.cat([kept, weight.new_zeros(rows - kept.shape[0], *weight.shape[1:])])


# per-layer names: Megatron model-local suffix <- Hugging Face suffix (1:1 tensors)
LAYER_SAME = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def hf_layer_names(arch: Arch, i: int) -> list[str]:
    """Every Hugging Face tensor name of decoder layer i."""
    p = f"model.layers.{i}."
    names = [p + s for s in LAYER_SAME.values()]
    names += [p + f"self_attn.{x}_proj.weight" for x in "qkv"] + [p + f"mlp.{x}_proj.weight" for x in ("gate", "up")]
    if arch.qkv_bias:
        names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    return names


def hf_to_mg_layer(arch: Arch, i: int, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer i's Hugging Face tensors (full names) -> Megatron model-local suffixes."""
    p = f"model.layers.{i}."
    out = {mg: hf[p + name] for mg, name in LAYER_SAME.items()}
    att = p + "self_attn."
    out["self_attention.linear_qkv.weight"] = fuse_qkv(
        arch, hf[att + "q_proj.weight"], hf[att + "k_proj.weight"], hf[att + "v_proj.weight"])
    if arch.qkv_bias:
        out["self_attention.linear_qkv.bias"] = fuse_qkv(
            arch, hf[att + "q_proj.bias"], hf[att + "k_proj.bias"], hf[att + "v_proj.bias"])
    out["mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    return out


def mg_to_hf_layer(arch: Arch, i: int, mg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of hf_to_mg_layer."""
    p = f"model.layers.{i}."
    out = {p + name: mg[m] for m, name in LAYER_SAME.items()}
    att = p + "self_attn."
    for x, t in zip("qkv", split_qkv(arch, mg["self_attention.linear_qkv.weight"])):
        out[att + f"{x}_proj.weight"] = t
    if arch.qkv_bias:
        for x, t in zip("qkv", split_qkv(arch, mg["self_attention.linear_qkv.bias"])):
            out[att + f"{x}_proj.bias"] = t
    gate, up = mg["mlp.linear_fc1.weight"].chunk(2)
    out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
    return out


def hf_global_names(arch: Arch) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    return names if arch.tied_embeddings else names + ["lm_head.weight"]


# Megatron model-local name <- Hugging Face name, outside the decoder layers
GLOBAL_NAMES = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                "decoder.final_layernorm.weight": "model.norm.weight",
                "output_layer.weight": "lm_head.weight"}


def hf_shapes(arch: Arch) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor of the model and its shape."""
    h, d, f, v = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size, arch.vocab_size
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not arch.tied_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
        if arch.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes
