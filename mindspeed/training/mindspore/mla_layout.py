"""What multi-latent attention (--multi-latent-attention) adds to the MindSpore GPT's config and
layout: its sizes and softmax scale from the flags (Megatron-Core 0.16's MLASelfAttention), and each
layer's attention weights under Megatron-Core's local-spec names. MindSpore-free, as param_layout.py;
the forward is mla.py."""
from __future__ import annotations

import math
from dataclasses import dataclass

from mindspeed.checkpoint import neutral as nf
from mindspeed.flags.family_flags import yarn_settings

# Megatron-Core 0.16's MLATransformerConfig defaults that its softmax scale reads when YaRN's flags are not given
DEFAULT_ROTARY_SCALING_FACTOR = 40.0
DEFAULT_MSCALE_ALL_DIM = 0.0
NORMS = ("q_layernorm", "kv_layernorm")


@dataclass(frozen=True)
class MLASizes:
    q_lora_rank: int            # 0: no query compression (linear_q_proj)
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    softmax_scale: float

    @property
    def q_head_dim(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @classmethod
    def from_args(cls, args) -> "MLASizes | None":
        if not args.multi_latent_attention:
            return None
        settings = yarn_settings(args) if args.yarn else {}
        factor = settings.get("rotary_scaling_factor") or args.rotary_scaling_factor or DEFAULT_ROTARY_SCALING_FACTOR
        all_dim = args.mscale_all_dim if args.mscale_all_dim is not None else DEFAULT_MSCALE_ALL_DIM
        mscale = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
        q_head_dim = args.qk_head_dim + args.qk_pos_emb_head_dim
        return cls(q_lora_rank=args.q_lora_rank or 0, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                   qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
                   softmax_scale=mscale * mscale / math.sqrt(q_head_dim))


def attention_shapes(cfg, i: int) -> dict:
    """Layer i's attention weights (whole shapes, Megatron-Core's names)."""
    m, h, n = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    name = lambda s: nf.layer_name(i, f"self_attention.{s}")
    shapes = {name("linear_kv_down_proj.weight"): (m.kv_lora_rank + m.qk_pos_emb_head_dim, h),
              name("linear_kv_up_proj.weight"): (n * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank),
              name("linear_proj.weight"): (h, n * m.v_head_dim)}
    if m.q_lora_rank:
        shapes.update({name("linear_q_down_proj.weight"): (m.q_lora_rank, h),
                       name("linear_q_up_proj.weight"): (n * m.q_head_dim, m.q_lora_rank)})
    else:
        shapes[name("linear_q_proj.weight")] = (n * m.q_head_dim, h)
    if cfg.qk_layernorm:
        sizes = {"q_layernorm": m.q_lora_rank, "kv_layernorm": m.kv_lora_rank}
        parts = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
        shapes.update({name(f"{norm}.{part}"): (sizes[norm],) for norm in NORMS if sizes[norm] for part in parts})
    return shapes
