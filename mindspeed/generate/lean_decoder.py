"""Generation's forward over a Megatron-Core GPTModel's own weights, without its layer Python.

A decoding step of a small model is nearly all fixed per-call cost: Megatron-Core's
TransformerLayer, attention and TP-linear Python and about a thousand torch calls a step. This
decoder runs the same arithmetic on the same parameter tensors (no copies) in a few torch calls
per layer, and keeps its own KV cache with RoPE already applied to the keys (Megatron's static
cache re-applies RoPE to every cached key at every step). It covers the dense GPTs the trainers
build (RMSNorm or LayerNorm, SwiGLU or GELU, RoPE or learned positions, biases, q/k/v biases,
grouped queries, tied or untied output, tensor parallelism); anything else, and every dtype
but fp32, goes through Megatron-Core's own inference path (`unsupported` says why).
Norms, the embedding and RoPE are the model's own modules and functions."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer import attention as megatron_attention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer


def unsupported(model) -> str | None:
    """Why `model` needs Megatron-Core's own inference path, or None."""
    config = model.config
    # getattr: fields a Megatron-Core version lacks (attention_output_gate: 0.16's) or a GPTModel's (mtp)
    checks = [
        (model.pre_process and model.post_process, "a pipeline stage"),
        (config.params_dtype == torch.float32, f"{config.params_dtype} parameters"),
        (model.position_embedding_type in ("rope", "learned_absolute"),
         f"{model.position_embedding_type} positions"),
        (config.context_parallel_size == 1 and not config.sequence_parallel, "context or sequence parallelism"),
        (not config.multi_latent_attention and not config.qk_layernorm, "MLA or q/k norms"),
        (getattr(config, "window_size", None) is None, "windowed attention"),
        (not getattr(config, "attention_output_gate", False), "a gated attention output"),
        (not config.rotary_interleaved and getattr(config, "mrope_section", None) is None, "interleaved or multimodal RoPE"),
        (config.num_query_groups >= config.tensor_model_parallel_size, "fewer query groups than TP ranks"),
        (not config.apply_residual_connection_post_layernorm and not config.fp32_residual_connection,
         "a residual from the norm or in fp32"),
        (getattr(model, "mtp_process", False) is False, "multi-token prediction"),
    ]
    for ok, what in checks:
        if not ok:
            return what
    for layer in model.decoder.layers:
        if type(layer) is not TransformerLayer or not isinstance(layer.mlp, MLP):
            return f"a {type(layer).__name__} with a {type(layer.mlp).__name__}"
        if not isinstance(layer.cross_attention, IdentityOp):
            return "cross attention"
    return None


class LeanDecoder:
    """`logits(tokens, start)`: the next-token logits (all TP ranks' vocabulary) after `tokens`
    [1, s], which sit at positions start..start+s-1. With `cache=True` their keys and values are
    stored for the later steps (start must be 0 or the length already cached); without it the
    call attends over `tokens` alone (start 0), as recomputing the prefix does."""

    def __init__(self, model, max_length: int, tp_group, tp_size: int):
        self.model, self.config, self.max_length = model, model.config, max_length
        self.tp_group, self.tp_size = tp_group, tp_size
        attention = model.decoder.layers[0].self_attention
        self.heads = attention.num_attention_heads_per_partition
        self.groups = attention.num_query_groups_per_partition
        self.head_dim = attention.hidden_size_per_attention_head
        self.scale = self.config.softmax_scale or self.head_dim ** -0.5
        self.rope = model.rotary_pos_emb(max_length) if model.position_embedding_type == "rope" else None
        self.cp_group = attention.pg_collection.cp
        weight = next(model.parameters())
        shape = (len(model.decoder.layers), 2, 1, self.groups, max_length, self.head_dim)
        self.cache = torch.empty(shape, dtype=weight.dtype, device=weight.device)
        self.cached = 0

    def reset(self) -> None:
        """Forget the cached keys and values (a new sequence)."""
        self.cached = 0

    def logits(self, tokens: torch.Tensor, start: int, cache: bool = True) -> torch.Tensor:
        s = tokens.shape[1]
        # a prefix at 0 (causal) or one token after the cached ones: SDPA's causal mask is top-left
        if (start != self.cached if cache else start != 0) or (s > 1 and start > 0) or start + s > self.max_length:
            raise ValueError(f"tokens at {start}..{start + s} with {self.cached} cached of {self.max_length}")
        positions = torch.arange(start, start + s, device=tokens.device).unsqueeze(0)
        x = self.model.embedding(input_ids=tokens, position_ids=positions)        # [s, 1, h]
        rope = None if self.rope is None else self.rope[start:start + s]
        for index, layer in enumerate(self.model.decoder.layers):
            x = self._layer(layer, self.cache[index] if cache else None, x, rope, start)
        if cache:
            self.cached = start + s
        x = self.model.decoder.final_layernorm(x[-1:])
        weight = self.model.shared_embedding_or_output_weight() \
            if self.model.share_embeddings_and_output_weights else self.model.output_layer.weight
        out = F.linear(x, weight)
        if self.tp_size > 1:
            out = tensor_parallel.gather_from_tensor_model_parallel_region(out)
        return out[-1]                                                              # [1, vocab]

    def _layer(self, layer, cache, x, rope, start):
        attention = layer.self_attention
        s, hn = x.shape[0], self.head_dim
        qkv = F.linear(layer.input_layernorm(x), attention.linear_qkv.weight, attention.linear_qkv.bias)
        qkv = qkv.view(s, 1, self.groups, -1)
        q, k, v = torch.split(qkv, [qkv.shape[-1] - 2 * hn, hn, hn], dim=3)
        q = q.reshape(s, 1, self.heads, hn)
        if rope is not None:
            # the function the model's attention calls (a fused kernel where a feature swapped it in)
            q = megatron_attention.apply_rotary_pos_emb(q, rope, config=self.config, cp_group=self.cp_group)
            k = megatron_attention.apply_rotary_pos_emb(k, rope, config=self.config, cp_group=self.cp_group)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))                      # [1, heads, s, hn]
        if cache is not None:
            cache[0, :, :, start:start + s] = k
            cache[1, :, :, start:start + s] = v
            k, v = cache[0, :, :, :start + s], cache[1, :, :, :start + s]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1, scale=self.scale,
                                             enable_gqa=self.heads != self.groups)
        out = out.permute(2, 0, 1, 3).reshape(s, 1, self.heads * hn)
        x = x + self._row_parallel(attention.linear_proj, out)
        mlp = layer.mlp
        hidden = F.linear(layer.pre_mlp_layernorm(x), mlp.linear_fc1.weight, mlp.linear_fc1.bias)
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(hidden, 2, dim=-1)
            hidden = self.config.activation_func(gate) * up
        else:
            hidden = self.config.activation_func(hidden)
        return x + self._row_parallel(mlp.linear_fc2, hidden)

    def _row_parallel(self, linear, x):
        out = F.linear(x, linear.weight)
        if self.tp_size > 1:
            torch.distributed.all_reduce(out, group=self.tp_group)
        return out if linear.bias is None else out + linear.bias
