"""Where the MindSpore GPT's parameters live: their whole shapes under Megatron-Core's state-dict
names, Megatron's initial values, and which of them a rank holds: its pipeline stage's (the first
and the last stage share tied word embeddings), its expert-parallel rank's experts, and of each its
tensor-parallel shard (neutral_format's split), so checkpoints move between backends.

Works on numpy and a GPTConfig only (no MindSpore): the model (model.py) makes its parameters from
what this says."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from mindspeed.checkpoint import neutral as nf
from mindspeed.training.mindspore import mla_layout

if TYPE_CHECKING:
    from mindspeed.training.mindspore.gpt_config import GPTConfig
    from mindspeed.training.mindspore.parallel import ParallelState


# the model's sizes a parallel layout splits ---------------------------------------------------------
def check_divisible(cfg: GPTConfig, ps: ParallelState) -> None:
    """Refuse (ValueError) sizes that the tensor- or expert-parallel split cannot divide."""
    tp = ps.tp_size
    for what, value in (("attention heads", cfg.num_attention_heads), ("query groups", cfg.num_query_groups),
                        ("ffn hidden size", cfg.ffn_hidden_size), ("padded vocab", cfg.vocab_size)):
        if value % tp:
            raise ValueError(f"{what} {value} is not divisible by tensor parallel size {tp}")
    if cfg.num_attention_heads % cfg.num_query_groups:
        raise ValueError(f"{cfg.num_attention_heads} heads are not a multiple of {cfg.num_query_groups} query groups")
    if cfg.num_experts % ps.ep_size:
        raise ValueError(f"{cfg.num_experts} experts are not divisible by expert parallel size {ps.ep_size}")


# whole shapes and initial values --------------------------------------------------------------------
def full_shapes(cfg: GPTConfig) -> dict:
    """Every parameter's whole shape by name: embeddings, each computing layer, final norm, output layer."""
    h = cfg.hidden_size
    shapes = {"embedding.word_embeddings.weight": (cfg.vocab_size, h)}
    if cfg.position_embedding_type == "learned_absolute":
        shapes["embedding.position_embeddings.weight"] = (cfg.max_position_embeddings or cfg.seq_length, h)
    for i in cfg.real_layers():
        shapes.update(_layer_shapes(cfg, i))
    shapes["decoder.final_layernorm.weight"] = (h,)
    if cfg.normalization == "LayerNorm":
        shapes["decoder.final_layernorm.bias"] = (h,)
    if not cfg.tied_embeddings:
        shapes["output_layer.weight"] = (cfg.vocab_size, h)
    for k in range(cfg.mtp_num_layers):
        shapes.update(_mtp_layer_shapes(cfg, k))
    return shapes


def _mtp_layer_shapes(cfg: GPTConfig, k: int) -> dict:
    """MTP layer k's weights (Megatron-Core's names): its norms, eh_proj, and a decoder layer's under
    mtp.layers.k.transformer_layer (numbered after the decoder's layers)."""
    h, prefix = cfg.hidden_size, f"mtp.layers.{k}."
    norms = [f"{prefix}{norm}.{part}" for norm in ("enorm", "hnorm", "final_layernorm")
             for part in (("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",))]
    shapes = {name: (h,) for name in norms}
    shapes[f"{prefix}eh_proj.weight"] = (h, 2 * h)
    decoder_prefix = nf.layer_name(cfg.num_layers + k, "")
    shapes.update({f"{prefix}transformer_layer.{name[len(decoder_prefix):]}": shape
                   for name, shape in _layer_shapes(cfg, cfg.num_layers + k).items()})
    return shapes


def _layer_shapes(cfg: GPTConfig, i: int) -> dict:
    """Decoder layer i's weights: norms, attention, the dense or MoE MLP (cfg.is_moe), the biases switched on."""
    h = cfg.hidden_size
    fc1 = (2 if cfg.swiglu else 1) * cfg.ffn_hidden_size
    shapes = {nf.layer_name(i, "input_layernorm.weight"): (h,)}
    shapes.update(mla_layout.attention_shapes(cfg, i) if cfg.mla else _attention_shapes(cfg, i))
    shapes[nf.layer_name(i, "pre_mlp_layernorm.weight")] = (h,)
    shapes.update(_moe_shapes(cfg, i) if cfg.is_moe(i) else
                  {nf.layer_name(i, "mlp.linear_fc1.weight"): (fc1, h),
                   nf.layer_name(i, "mlp.linear_fc2.weight"): (h, cfg.ffn_hidden_size)})
    if cfg.normalization == "LayerNorm":
        shapes.update({nf.layer_name(i, "input_layernorm.bias"): (h,),
                       nf.layer_name(i, "pre_mlp_layernorm.bias"): (h,)})
    if cfg.add_bias_linear:
        shapes.update({nf.layer_name(i, "self_attention.linear_proj.bias"): (h,),
                       nf.layer_name(i, "mlp.linear_fc1.bias"): (fc1,),
                       nf.layer_name(i, "mlp.linear_fc2.bias"): (h,)})
    return shapes


def _attention_shapes(cfg: GPTConfig, i: int) -> dict:
    """Layer i's (grouped-query) attention: linear_qkv, linear_proj, the q/k norms, the qkv bias."""
    h, d = cfg.hidden_size, cfg.kv_channels
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d
    shapes = {nf.layer_name(i, "self_attention.linear_qkv.weight"): (qkv, h),
              nf.layer_name(i, "self_attention.linear_proj.weight"): (h, cfg.num_attention_heads * d)}
    shapes.update(_qk_norm_shapes(cfg, i))
    if cfg.add_bias_linear or cfg.add_qkv_bias:
        shapes[nf.layer_name(i, "self_attention.linear_qkv.bias")] = (qkv,)
    return shapes


def _qk_norm_shapes(cfg: GPTConfig, i: int) -> dict:
    """--qk-layernorm: layer i's norms of the queries and the keys, per head over head_dim (one
    weight the heads share, replicated over TP: Megatron-Core's q_layernorm / k_layernorm);
    LayerNorm's with biases."""
    if not cfg.qk_layernorm:
        return {}
    parts = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
    return {nf.layer_name(i, f"self_attention.{norm}.{part}"): (cfg.kv_channels,)
            for norm in nf.QK_NORMS for part in parts}


def _moe_shapes(cfg: GPTConfig, i: int) -> dict:
    """Layer i's MoE weights: the router, every expert (global index), the shared experts."""
    h, gate = cfg.hidden_size, 2 if cfg.swiglu else 1
    shapes = {nf.layer_name(i, "mlp.router.weight"): (cfg.num_experts, h)}
    for e in range(cfg.num_experts):
        shapes.update({nf.expert_name(i, e, "linear_fc1.weight"): (gate * cfg.moe_ffn_hidden_size, h),
                       nf.expert_name(i, e, "linear_fc2.weight"): (h, cfg.moe_ffn_hidden_size)})
    if cfg.moe_shared_expert_size:
        shapes.update({nf.layer_name(i, "mlp.shared_experts.linear_fc1.weight"): (gate * cfg.moe_shared_expert_size, h),
                       nf.layer_name(i, "mlp.shared_experts.linear_fc2.weight"): (h, cfg.moe_shared_expert_size)})
    return shapes


def init_full_weights(cfg: GPTConfig, seed: int) -> dict:
    """Megatron's init on whole tensors (TP-independent, like use_cpu_initialization): normal(0, std),
    output projections std/sqrt(2L), norms ones."""
    rng = np.random.RandomState(seed)
    scaled = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    weights = {}
    for name, shape in cfg.full_shapes().items():
        if name.endswith(("layernorm.weight", "enorm.weight", "hnorm.weight")):      # MTP's norms too
            weights[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            weights[name] = np.zeros(shape, np.float32)
        else:
            std = scaled if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else cfg.init_method_std
            weights[name] = rng.normal(0.0, std, shape).astype(np.float32)
    return weights


# what a rank holds -----------------------------------------------------------------------------------
def stage_shapes(cfg: GPTConfig, pp_rank: int, pp_size: int) -> dict:
    """The whole shapes of the parameters pipeline stage pp_rank (of pp_size) holds."""
    layers = cfg.stage_layers(pp_rank)

    def on_stage(name):
        if name.startswith("decoder.layers."):
            return int(name.split(".")[2]) in layers
        if name in shared_across_stages(cfg, pp_size):
            return pp_rank in (0, pp_size - 1)
        return pp_rank == 0 if name.startswith("embedding.") else pp_rank == pp_size - 1   # norm, output layer
    return {n: s for n, s in cfg.full_shapes().items() if on_stage(n)}


def shared_across_stages(cfg: GPTConfig, pp_size: int) -> tuple:
    """Weights the first and the last pipeline stage both hold: tied word embeddings (the last
    stage's output layer is a copy, kept equal by summing the two stages' gradients, as
    Megatron's embedding group does)."""
    return ("embedding.word_embeddings.weight",) if cfg.tied_embeddings and pp_size > 1 else ()


def owned_shapes(cfg: GPTConfig, ps: ParallelState) -> dict:
    """The whole shapes of the parameters this pipeline stage holds (all of them without PP),
    with expert parallelism only this EP rank's experts."""
    return {n: s for n, s in stage_shapes(cfg, ps.pp_rank, ps.pp_size).items()
            if not nf.is_expert(n) or owns_expert(cfg, ps, nf.expert_of(n))}


def owns_expert(cfg: GPTConfig, ps: ParallelState, e: int) -> bool:
    return nf.expert_owner(e, cfg.num_experts, ps.ep_size) == ps.ep_rank


def is_tp_sharded(cfg: GPTConfig, name: str) -> bool:
    return nf.split_kind(name, cfg.swiglu, cfg.experts_tp_sharded) != "replicated"


def counted_in_grad_norm(cfg: GPTConfig, ps: ParallelState, name: str) -> bool:
    """Whether this rank's gradient of `name` enters the global norm: each element once, as
    Megatron counts it: replicated weights on TP rank 0 only, a weight shared across stages on
    the first stage only."""
    if name in shared_across_stages(cfg, ps.pp_size) and not ps.first_stage:
        return False
    return is_tp_sharded(cfg, name) or ps.tp_rank == 0


# whole tensors to this rank's shards ----------------------------------------------------------------
def check_fits(cfg: GPTConfig, ps: ParallelState, full: dict) -> dict:
    """The owned shapes (owned_shapes) when whole tensors `full` (Megatron names) hold them all,
    else ValueError naming every missing or misshapen tensor."""
    expected = owned_shapes(cfg, ps)
    missing = sorted(set(expected) - set(full))
    wrong = [f"{k}: {tuple(full[k].shape)} != {expected[k]}" for k in expected
             if k in full and tuple(full[k].shape) != tuple(expected[k])]
    if missing or wrong:
        raise ValueError("checkpoint does not fit this model: "
                         + "; ".join(([f"missing {', '.join(missing)}"] if missing else []) + wrong))
    return expected


def tp_shard(cfg: GPTConfig, ps: ParallelState, name: str, whole) -> np.ndarray:
    """This TP rank's fp32 shard of the whole tensor `whole` of parameter `name`."""
    return nf.shard_for_rank(name, np.asarray(whole, np.float32), ps.tp_rank, ps.tp_size, cfg.swiglu,
                             cfg.experts_tp_sharded)
