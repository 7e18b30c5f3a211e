"""Tensor layouts: Hugging Face Llama/Qwen2/Qwen3/Qwen3-MoE/Mixtral names and shapes <-> Megatron-Core
GPTModel (local spec).

Megatron fuses q, k and v into one `linear_qkv` whose rows are grouped by query group:
for each of the G key/value heads, that group's H/G query heads, then its k head, then its v head
(each head `head_dim` rows). TP shards are contiguous runs of whole groups, so this global layout
is the same at every tensor-parallel size. SwiGLU's `linear_fc1` is [gate; up].
Both Llama and Qwen2 keep q/k rows in the rotate-half order that Megatron's (non-interleaved) RoPE
uses, so no per-head permutation is needed. Qwen3's per-head q/k RMSNorms are Megatron-Core's
q_layernorm / k_layernorm. An MoE layer is Megatron-Core's MoELayer with the local spec's SequentialMLP:
the router's weight is `mlp.router.weight`, expert e's SwiGLU is `mlp.experts.local_experts.e.linear_fc1`
([gate; up]) and `linear_fc2` (the global index e: torch_dist keeps global experts, whatever the EP size).
"""
from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class Part:
    """One Megatron tensor of a decoder layer and the Hugging Face tensors it is made of.
    kind: "same" (one tensor as it is), "qkv" (q, k, v fused by query group: fuse_qkv) or "fc1"
    (SwiGLU's [gate; up])."""
    mg: str                                        # model-local suffix in the layer
    hf: tuple[tuple[str, tuple[int, ...]], ...]    # (suffix in model.layers.i., shape) each
    kind: str = "same"

    @property
    def mg_shape(self) -> tuple[int, ...]:
        if self.kind == "same":
            return self.hf[0][1]
        return (sum(shape[0] for _, shape in self.hf), *self.hf[0][1][1:])


# the MoE block's Hugging Face names: (prefix, router, expert linears gate / up / down)
MOE_NAMES = {"qwen3_moe": ("mlp.", "gate.weight", ("gate_proj", "up_proj", "down_proj")),
             "mixtral": ("block_sparse_moe.", "gate.weight", ("w1", "w3", "w2"))}
EXPERT = "mlp.experts.local_experts."        # Megatron's SequentialMLP: global expert e at EP 1


def _swiglu(mg: str, hf: str, names: tuple[str, str, str], ffn: int, h: int) -> list[Part]:
    """A SwiGLU MLP: Megatron's fc1 [gate; up] and fc2 (mg, hf: the two modules' prefixes)."""
    gate, up, down = (f"{hf}{n}.weight" for n in names)
    return [Part(mg + "linear_fc1.weight", ((gate, (ffn, h)), (up, (ffn, h))), "fc1"),
            Part(mg + "linear_fc2.weight", ((down, (h, ffn)),))]


def layer_parts(arch: Arch, i: int) -> list[Part]:
    """Every tensor of decoder layer i, Megatron's side and Hugging Face's."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    att = "self_attn."
    parts = [Part("input_layernorm.weight", (("input_layernorm.weight", (h,)),)),
             Part("self_attention.linear_qkv.weight", ((att + "q_proj.weight", (q, h)),
                                                        (att + "k_proj.weight", (kv, h)),
                                                        (att + "v_proj.weight", (kv, h))), "qkv"),
             Part("self_attention.linear_proj.weight", ((att + "o_proj.weight", (h, q)),)),
             Part("pre_mlp_layernorm.weight", (("post_attention_layernorm.weight", (h,)),))]
    if arch.qkv_bias:
        parts.append(Part("self_attention.linear_qkv.bias", ((att + "q_proj.bias", (q,)), (att + "k_proj.bias", (kv,)),
                                                             (att + "v_proj.bias", (kv,))), "qkv"))
    if arch.qk_layernorm:     # per head, shared by the heads: Megatron-Core's q_layernorm / k_layernorm
        parts += [Part("self_attention.q_layernorm.weight", ((att + "q_norm.weight", (d,)),)),
                  Part("self_attention.k_layernorm.weight", ((att + "k_norm.weight", (d,)),))]
    if not arch.is_moe_layer(i):
        return parts + _swiglu("mlp.", "mlp.", ("gate_proj", "up_proj", "down_proj"), arch.ffn_hidden_size, h)
    prefix, router, names = MOE_NAMES[arch.family]
    parts.append(Part("mlp.router.weight", ((prefix + router, (arch.num_experts, h)),)))
    for e in range(arch.num_experts):
        parts += _swiglu(f"{EXPERT}{e}.", f"{prefix}experts.{e}.", names, arch.moe_ffn_hidden_size, h)
    return parts


def hf_layer_names(arch: Arch, i: int) -> list[str]:
    """Every Hugging Face tensor name of decoder layer i."""
    p = f"model.layers.{i}."
    return [p + name for part in layer_parts(arch, i) for name, _ in part.hf]


def mg_layer_shapes(arch: Arch, i: int) -> dict[str, tuple[int, ...]]:
    """Decoder layer i's Megatron tensors (model-local suffixes) and their whole shapes."""
    return {part.mg: part.mg_shape for part in layer_parts(arch, i)}


def hf_to_mg_layer(arch: Arch, i: int, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer i's Hugging Face tensors (full names) -> Megatron model-local suffixes."""
    p = f"model.layers.{i}."
    out = {}
    for part in layer_parts(arch, i):
        tensors = [hf[p + name] for name, _ in part.hf]
        if part.kind == "qkv":
            out[part.mg] = fuse_qkv(arch, *tensors)
        elif part.kind == "fc1":
            out[part.mg] = torch.cat(tensors)
        else:
            out[part.mg] = tensors[0]
    return out


def mg_to_hf_layer(arch: Arch, i: int, mg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of hf_to_mg_layer."""
    p = f"model.layers.{i}."
    out = {}
    for part in layer_parts(arch, i):
        tensor = mg[part.mg]
        if part.kind == "qkv":
            pieces = split_qkv(arch, tensor)
        elif part.kind == "fc1":
            pieces = tuple(t.contiguous() for t in tensor.chunk(2))
        else:
            pieces = (tensor,)
        out.update({p + name: t for (name, _), t in zip(part.hf, pieces)})
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
    h, v = arch.hidden_size, arch.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not arch.tied_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(arch.num_layers):
        shapes.update({f"model.layers.{i}.{name}": shape for part in layer_parts(arch, i) for name, shape in part.hf})
    return shapes
