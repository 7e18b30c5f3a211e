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
             "mixtral": ("block_sparse_moe.", "gate.weight", ("w1", "w3", "w2")),
             "deepseek_v3": ("mlp.", "gate.weight", ("gate_proj", "up_proj", "down_proj"))}
EXPERT = "mlp.experts.local_experts."        # Megatron's SequentialMLP: global expert e at EP 1
DENSE = ("gate_proj", "up_proj", "down_proj")


def _swiglu(mg: str, hf: str, names: tuple[str, str, str], ffn: int, h: int) -> list[Part]:
    """A SwiGLU MLP: Megatron's fc1 [gate; up] and fc2 (mg, hf: the two modules' prefixes)."""
    gate, up, down = (f"{hf}{n}.weight" for n in names)
    return [Part(mg + "linear_fc1.weight", ((gate, (ffn, h)), (up, (ffn, h))), "fc1"),
            Part(mg + "linear_fc2.weight", ((down, (h, ffn)),))]


def _same(mg: str, hf: str, shape: tuple[int, ...]) -> Part:
    return Part(mg, ((hf, shape),))


def _attention(arch: Arch) -> list[Part]:
    h, d, att = arch.hidden_size, arch.head_dim, "self_attn."
    if arch.mla is not None:   # DeepSeek's multi-latent attention: Megatron-Core's MLASelfAttention
        q_rank, kv_rank, nope, rope, v = arch.mla
        heads, sa = arch.num_heads, "self_attention."
        parts = [_same(sa + "linear_proj.weight", att + "o_proj.weight", (h, heads * v)),
                 _same(sa + "linear_kv_down_proj.weight", att + "kv_a_proj_with_mqa.weight", (kv_rank + rope, h)),
                 _same(sa + "kv_layernorm.weight", att + "kv_a_layernorm.weight", (kv_rank,)),
                 _same(sa + "linear_kv_up_proj.weight", att + "kv_b_proj.weight", (heads * (nope + v), kv_rank))]
        if q_rank is None:
            return parts + [_same(sa + "linear_q_proj.weight", att + "q_proj.weight", (heads * (nope + rope), h))]
        return parts + [_same(sa + "linear_q_down_proj.weight", att + "q_a_proj.weight", (q_rank, h)),
                        _same(sa + "q_layernorm.weight", att + "q_a_layernorm.weight", (q_rank,)),
                        _same(sa + "linear_q_up_proj.weight", att + "q_b_proj.weight", (heads * (nope + rope), q_rank))]
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    parts = [Part("self_attention.linear_qkv.weight", ((att + "q_proj.weight", (q, h)),
                                                       (att + "k_proj.weight", (kv, h)),
                                                       (att + "v_proj.weight", (kv, h))), "qkv"),
             _same("self_attention.linear_proj.weight", att + "o_proj.weight", (h, q))]
    if arch.qkv_bias:
        parts.append(Part("self_attention.linear_qkv.bias", ((att + "q_proj.bias", (q,)), (att + "k_proj.bias", (kv,)),
                                                             (att + "v_proj.bias", (kv,))), "qkv"))
    if arch.qk_layernorm:     # per head, shared by the heads: Megatron-Core's q_layernorm / k_layernorm
        parts += [_same("self_attention.q_layernorm.weight", att + "q_norm.weight", (d,)),
                  _same("self_attention.k_layernorm.weight", att + "k_norm.weight", (d,))]
    return parts


def layer_parts(arch: Arch, i: int) -> list[Part]:
    """Every tensor of decoder layer i (or of the transformer layer of MTP layer i - num_layers),
    Megatron's side (model-local, in the layer) and Hugging Face's (in model.layers.i.)."""
    h = arch.hidden_size
    parts = [_same("input_layernorm.weight", "input_layernorm.weight", (h,)), *_attention(arch),
             _same("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", (h,))]
    if not arch.is_moe_layer(i):
        return parts + _swiglu("mlp.", "mlp.", DENSE, arch.ffn_hidden_size, h)
    prefix, router, names = MOE_NAMES[arch.family]
    parts.append(_same("mlp.router.weight", prefix + router, (arch.num_experts, h)))
    if arch.router_sigmoid:    # DeepSeek-V3's aux-loss-free balancing bias: Megatron-Core's expert bias
        parts.append(_same("mlp.router.expert_bias", prefix + "gate.e_score_correction_bias", (arch.num_experts,)))
    for e in range(arch.num_experts):
        parts += _swiglu(f"{EXPERT}{e}.", f"{prefix}experts.{e}.", names, arch.moe_ffn_hidden_size, h)
    if arch.shared_expert_ffn:
        parts += _swiglu("mlp.shared_experts.", prefix + "shared_experts.", DENSE, arch.shared_expert_ffn, h)
    return parts


# an MTP layer's Hugging Face tensors that are the main model's in Megatron-Core (it shares them): on the
# way back they are written as copies of those, as DeepSeek-V3's checkpoints hold them
MTP_SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def block_parts(arch: Arch, i: int) -> list[Part]:
    """Decoder layer i's parts; for i >= num_layers, MTP layer i - num_layers' (Megatron-Core's
    MultiTokenPredictionLayer: norms of the embedding and the hidden state, their projection, a
    transformer layer and a final norm), Hugging Face's model.layers.i. (DeepSeek-V3's layout)."""
    if i < arch.num_layers:
        return layer_parts(arch, i)
    h = arch.hidden_size
    return [Part("transformer_layer." + p.mg, p.hf, p.kind) for p in layer_parts(arch, i)] + [
        _same("enorm.weight", "enorm.weight", (h,)), _same("hnorm.weight", "hnorm.weight", (h,)),
        _same("eh_proj.weight", "eh_proj.weight", (h, 2 * h)),
        _same("final_layernorm.weight", "shared_head.norm.weight", (h,))]


def mg_prefix(arch: Arch, i: int) -> str:
    """Where block i's Megatron tensors are: decoder layer i, or MTP layer i - num_layers."""
    return f"decoder.layers.{i}." if i < arch.num_layers else f"mtp.layers.{i - arch.num_layers}."


def hf_layer_names(arch: Arch, i: int) -> list[str]:
    """Every Hugging Face tensor name of block i that has a Megatron tensor."""
    p = f"model.layers.{i}."
    return [p + name for part in block_parts(arch, i) for name, _ in part.hf]


def mg_layer_shapes(arch: Arch, i: int) -> dict[str, tuple[int, ...]]:
    """Block i's Megatron tensors (relative to mg_prefix) and their whole shapes."""
    return {part.mg: part.mg_shape for part in block_parts(arch, i)}


def hf_to_mg_layer(arch: Arch, i: int, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Block i's Hugging Face tensors (full names) -> Megatron names relative to mg_prefix."""
    p = f"model.layers.{i}."
    out = {}
    for part in block_parts(arch, i):
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
    for part in block_parts(arch, i):
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
    for i in range(arch.num_layers + arch.mtp_layers):
        shapes.update({f"model.layers.{i}.{name}": shape for part in block_parts(arch, i) for name, shape in part.hf})
        if i >= arch.num_layers:
            shapes.update({f"model.layers.{i}.{name}": (v, h) for name in MTP_SHARED})
    return shapes
