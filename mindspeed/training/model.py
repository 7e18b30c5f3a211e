"""The GPT that both trainers build: Megatron-Core GPTModel with the local (no TE/Apex) spec,
RMSNorm, SwiGLU MLP, RoPE, no linear biases (optionally q/k/v biases), untied-or-tied output layer.

`transformer_config(args)` is the single place that maps flags to TransformerConfig, so the
MindSpore trainer can mirror exactly the same architecture from the same args.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_layer_local_spec,
                                                      get_gpt_mtp_block_spec)
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from mindspeed.features.parallel.dualpipev import dualpipev_on
from mindspeed.features.parallel.unaligned_pipeline import layer_matrix
from mindspeed.flags.family_flags import moe_layer_pattern
from mindspeed.training.layer_spec import SpecModules, block_with_final_norm, with_modules

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformer_config(args) -> TransformerConfig:
    dtype = DTYPES[args.params_dtype]
    config_class = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    config = config_class(
        **_family_fields(args),
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        **_pipeline_fields(args),
        sequence_parallel=args.sequence_parallel,
        context_parallel_size=args.context_parallel_size,
        **_moe_fields(args),
        variable_seq_lengths=args.variable_seq_lengths,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        deterministic_mode=args.deterministic_mode,
        transformer_impl="local",          # Transformer Engine is refused in validate_args
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        # Megatron fuses scale-mask-softmax by default where its CUDA extension is installed
        masked_softmax_fusion=args.masked_softmax_fusion and fused_softmax_installed(args),
        # Megatron's other fused paths need Apex/TE/CUDA; MindSpeed features swap in fused kernels
        # (--no-*-fusion flags that contradict those features are refused in validate_args).
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=False,
    )
    if args.yarn and not config.multi_latent_attention:
        _set_dense_yarn(config, args)
    return config


def _pipeline_fields(args) -> dict:
    """Megatron-Core's pipeline fields: stages, virtual stages, the layers of each, the p2p mode."""
    vpp = virtual_stages(args)
    return dict(
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        # Megatron-LM's default under the interleaved schedule: batched p2p at PP 2 would post both
        # directions' sends and receives between the same two ranks in one batch, and gloo pairs
        # them by order (a gradient lands in an activation's buffer)
        overlap_p2p_comm=vpp is not None,
        batch_p2p_comm=vpp is None,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        # --num-layer-list / --pipeline-num-transformer-layers (their features set it through adapt(args))
        pipeline_model_parallel_layout=getattr(args, "pipeline_model_parallel_layout", None),
    )


def _moe_fields(args) -> dict:
    """Megatron-Core's MoE fields (its defaults without --num-experts)."""
    return dict(expert_model_parallel_size=args.expert_model_parallel_size, num_moe_experts=args.num_experts,
                moe_router_topk=args.moe_router_topk,
                moe_ffn_hidden_size=args.moe_ffn_hidden_size or (args.ffn_hidden_size if args.num_experts else None),
                moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                moe_shared_expert_overlap=args.moe_shared_expert_overlap)


def _family_fields(args) -> dict:
    """The model-family flags (flags/family_flags.py) as TransformerConfig fields; none for a namespace
    without them (a host's own)."""
    if not hasattr(args, "qk_layernorm"):
        return {}
    fields = dict(qk_layernorm=args.qk_layernorm, mtp_num_layers=args.mtp_num_layers,
                  mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)
    if args.num_experts:
        fields.update(
            # every layer MoE: Megatron's default (1), which keeps its stacked-layer checkpoint keys
            moe_layer_freq=1 if all(moe_layer_pattern(args)) else moe_layer_pattern(args),
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_router_score_function=args.moe_router_score_function,
            moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=args.moe_router_bias_update_rate,
            moe_router_num_groups=args.moe_router_num_groups,
            moe_router_group_topk=args.moe_router_group_topk,
            moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_router_dtype=args.moe_router_dtype,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    if args.multi_latent_attention:
        fields.update(q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                      qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
                      rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
                      rope_type="yarn" if args.yarn else "rope", **_yarn_values(args))
    return fields


def _yarn_values(args) -> dict:
    """YaRN's settings with Megatron-Core's defaults for those not given."""
    given = dict(rotary_scaling_factor=args.rotary_scaling_factor, beta_fast=args.beta_fast,
                 beta_slow=args.beta_slow, mscale=args.mscale, mscale_all_dim=args.mscale_all_dim,
                 original_max_position_embeddings=args.rope_scaling_original_max_position_embeddings)
    return {k: v for k, v in given.items() if v is not None}


def _set_dense_yarn(config, args) -> None:
    """GPTModel reads YaRN's settings for a dense model from yarn_* attributes of its config (Megatron-Core
    0.16 declares them only on MLATransformerConfig, without the prefix)."""
    defaults = {f.name: f.default for f in MLATransformerConfig.__dataclass_fields__.values()}
    values = {k: defaults[k] for k in ("rotary_scaling_factor", "beta_fast", "beta_slow", "mscale",
                                       "mscale_all_dim", "original_max_position_embeddings")}
    values.update(_yarn_values(args))
    for name, value in values.items():
        setattr(config, f"yarn_{name}", value)
    config.yarn_correction_range_round_to_int = True


SOFTMAX_EXTENSIONS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda")


def fused_softmax_installed(args) -> bool:
    """Megatron-Core's fused softmax imports these CUDA extensions (Apex / Megatron's fused kernels)
    at call time: only a cuda device with all of them installed can take that path."""
    if getattr(args, "device_name", None) != "cuda":     # set by the run (absent for a config built before it)
        return False
    return all(importlib.util.find_spec(name) is not None for name in SOFTMAX_EXTENSIONS)


def virtual_stages(args) -> int | None:
    """Model chunks per pipeline stage (None without a virtual pipeline): the columns of the
    unaligned pipeline's matrix or layout, else --num-layers-per-virtual-pipeline-stage's split."""
    if dualpipev_on(args):
        return 2                # the V's two chunks (built as training/dualpipev.py runs them)
    rows = layer_matrix(args)
    if rows is not None:
        return len(rows[0]) if len(rows[0]) > 1 else None
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        return None
    return args.num_layers // args.pipeline_model_parallel_size // per_stage


def layer_spec(args, config=None, vp_stage=None):
    """Megatron-Core's local spec; a per-layer block spec where dense and MoE layers mix."""
    pattern = moe_layer_pattern(args)
    if config is not None and pattern is not None and not all(pattern):
        return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                          vp_stage=vp_stage)
    return get_gpt_layer_local_spec(num_experts=args.num_experts, normalization=args.normalization,
                                    qk_layernorm=args.qk_layernorm,
                                    multi_latent_attention=args.multi_latent_attention)


def mtp_spec(args, config, decoder_spec, vp_stage=None):
    """Megatron-Core's MTP block for --mtp-num-layers (None elsewhere, and on stages that hold none of it)."""
    if not args.mtp_num_layers:
        return None
    last = decoder_spec.layer_specs[-1] if hasattr(decoder_spec, "layer_specs") and decoder_spec.layer_specs \
        else decoder_spec
    return get_gpt_mtp_block_spec(config, last, use_transformer_engine=False, vp_stage=vp_stage)


def specs_with_modules(args, config, vp_stage, modules: SpecModules | None) -> tuple:
    """(decoder spec, MTP block spec or None) of this stage: Megatron-Core's local ones with the
    modules the run's features provide (training/layer_spec.py) in their slots."""
    spec = layer_spec(args, config, vp_stage)
    mtp = mtp_spec(args, config, spec, vp_stage)
    if modules is None or not modules.any:
        return spec, mtp
    if modules.norm is not None and isinstance(spec, ModuleSpec):   # the final norm too, as a block
        spec = block_with_final_norm(spec, config, vp_stage, modules.norm)
    experts = args.num_experts
    return with_modules(spec, modules, experts), (None if mtp is None else with_modules(mtp, modules, experts))


def build_model_chunks(args, config: TransformerConfig, modules: SpecModules | None = None) -> list[GPTModel]:
    """One GPTModel per virtual pipeline stage held by this rank (one without VPP); `modules`: what
    the session's features put into the layer spec (SpecModules.of(session); None: the spec as
    Megatron-Core's providers give it, patched or not)."""
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        spec, mtp = specs_with_modules(args, config, stage, modules)
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=spec,
            mtp_block_spec=mtp,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=_holds_end(args, "first", stage),
            post_process=_holds_end(args, "last", stage),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=_position_embedding_type(args, config),
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            rope_scaling=args.use_rope_scaling,
            rope_scaling_factor=args.rope_scaling_factor or 8.0,
            vp_stage=stage,
        ))
    for chunk in chunks:
        fold_mlp_input_biases(chunk)
    if dualpipev_on(args) and chunks[0].pre_process and chunks[1].mtp_process:
        # the MTP block's copy of the word embeddings (Megatron zeroes it and fills it from the first
        # stage over the embedding group: here that stage is this rank's chunk 0)
        chunks[1].embedding.word_embeddings.weight.data.copy_(chunks[0].embedding.word_embeddings.weight.data)
    return chunks


def _holds_end(args, end: str, vp_stage) -> bool:
    """Whether this chunk holds the model's first (embedding) or last (output layer, loss) stage. The
    V of --schedules-method dualpipev holds both on pipeline rank 0: chunk 0 the first, chunk 1 the last."""
    if dualpipev_on(args):
        return parallel_state.get_pipeline_model_parallel_rank() == 0 and vp_stage == (0 if end == "first" else 1)
    if end == "first":
        return parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    return parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


def _position_embedding_type(args, config) -> str:
    """GPTModel's position embedding: alibi's positions are biases in the attention (features/fused/alibi.py)."""
    if args.position_embedding_type == "alibi":
        return "none"
    return "yarn" if args.yarn and not config.multi_latent_attention else args.position_embedding_type


def fold_mlp_input_biases(model) -> int:
    """Dense MLPs whose activation is not fused add linear_fc1's bias right after it
    (`intermediate + bias`, Megatron's unfused branch): the linear adds it itself instead, where
    torch's linear puts it inside the GEMM. The same sum; returns how many MLPs changed."""
    folded = 0
    for module in model.modules():
        if type(module) is not MLP or module.config.bias_activation_fusion \
                or getattr(module.config, "use_te_activation_func", False):
            continue
        fc1 = module.linear_fc1
        if getattr(fc1, "bias", None) is not None and fc1.skip_bias_add:
            fc1.skip_bias_add = False
            folded += 1
    return folded


def count_parameters(chunks) -> int:
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())
