"""Multi-latent attention in the MindSpore GPT (--multi-latent-attention): Megatron-Core 0.16's
MLASelfAttention on its local spec, with its parameter names.

hidden -> q: linear_q_down_proj -> q_layernorm -> linear_q_up_proj (or linear_q_proj without
--q-lora-rank) -> heads of qk_head_dim + qk_pos_emb_head_dim; kv: linear_kv_down_proj ->
[kv_lora_rank | k_pos_emb] -> kv_layernorm on the first part -> linear_kv_up_proj -> heads of
qk_head_dim + v_head_dim. RoPE (plain or YaRN, rope.py's tables) rotates only the positional parts,
whose channels Megatron-Core first de-interleaves (even ones, then odd ones); k_pos_emb is one head
all heads share. Core attention with Megatron-Core's softmax scale (YaRN's mscale squared over
sqrt(q head size)); linear_proj maps the heads' v_head_dim outputs back. The norms exist with
--qk-layernorm (the local spec's IdentityOp otherwise). Tensor parallelism is refused by the gate
(features/model_family_options.py): this runs at TP 1.
"""
from __future__ import annotations

from mindspore import ops

from mindspeed.training.mindspore import rope
from mindspeed.training.mindspore.layers import column_parallel


def deinterleaved(x):
    """Megatron-Core's MLA RoPE input: the channels' even ones, then the odd ones."""
    return ops.cat((x[..., 0::2], x[..., 1::2]), axis=-1)


def query_key_value(model, i: int, x, positions=None):
    """q [s, b, n*q_head], k [s, b, n*q_head], v [s, b, n*v_head] of layer i (this rank's heads)."""
    m, n, backend, ps = model.cfg.mla, model.heads_local, model.backend, model.ps
    p = lambda s: model.params[model.layer_name(i, f"self_attention.{s}")]
    if m.q_lora_rank:
        q = column_parallel(backend, ps, model.mla_norm(i, "q_layernorm", column_parallel(
            backend, ps, x, p("linear_q_down_proj.weight"))), p("linear_q_up_proj.weight"))
    else:
        q = column_parallel(backend, ps, x, p("linear_q_proj.weight"))
    kv_combined = column_parallel(backend, ps, x, p("linear_kv_down_proj.weight"))
    kv_compressed, k_pos = ops.split(kv_combined, [m.kv_lora_rank, m.qk_pos_emb_head_dim], axis=-1)
    kv = column_parallel(backend, ps, model.mla_norm(i, "kv_layernorm", kv_compressed), p("linear_kv_up_proj.weight"))
    s, b = q.shape[0], q.shape[1]
    q_no_pe, q_pos = ops.split(q.reshape(s, b, n, m.q_head_dim), [m.qk_head_dim, m.qk_pos_emb_head_dim], axis=-1)
    k_no_pe, v = ops.split(kv.reshape(s, b, n, m.qk_head_dim + m.v_head_dim), [m.qk_head_dim, m.v_head_dim], axis=-1)
    cos, sin = rope.rows_at(model.cos, model.sin, s, positions)
    rotate = model.kernel("rope")
    q_pos = rotate(_rotary_part(q_pos, cos), cos, sin, 0)
    k_pos = rotate(_rotary_part(k_pos.expand_dims(2), cos), cos, sin, 0)
    k_pos = ops.broadcast_to(k_pos, (s, b, n, m.qk_pos_emb_head_dim))
    q = ops.cat((q_no_pe, q_pos), axis=-1).reshape(s, b, -1)
    k = ops.cat((k_no_pe, k_pos), axis=-1).reshape(s, b, -1)
    return q, k, v.reshape(s, b, -1)


def _rotary_part(x, cos):
    """x with its first rot_dim channels de-interleaved (rot_dim: the table's; the rest pass through)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return deinterleaved(x)
    return ops.cat((deinterleaved(x[..., :rot]), x[..., rot:]), axis=-1)
