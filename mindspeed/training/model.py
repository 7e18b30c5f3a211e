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
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformer_config(args) -> TransformerConfig:
    dtype = DTYPES[args.params_dtype]
    return TransformerConfig(
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
        add_qkv_bias=getattr(args, "add_qkv_bias", False),
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=_virtual_pp(args),
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers", None),
        # --num-layer-list (the uneven-pipeline-layers feature sets it through adapt(args))
        pipeline_model_parallel_layout=getattr(args, "pipeline_model_parallel_layout", None),
        sequence_parallel=args.sequence_parallel,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or (args.ffn_hidden_size if args.num_experts else None),
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_overlap=args.moe_shared_expert_overlap,
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


SOFTMAX_EXTENSIONS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda")


def fused_softmax_installed(args) -> bool:
    """Megatron-Core's fused softmax imports these CUDA extensions (Apex / Megatron's fused kernels)
    at call time: only a cuda device with all of them installed can take that path."""
    if getattr(args, "device_name", None) != "cuda":
        return False
    return all(importlib.util.find_spec(name) is not None for name in SOFTMAX_EXTENSIONS)


def _virtual_pp(args):
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        return None
    return args.num_layers // args.pipeline_model_parallel_size // per_stage


def layer_spec(args):
    return get_gpt_layer_local_spec(num_experts=args.num_experts, normalization=args.normalization)


def build_model_chunks(args, config: TransformerConfig) -> list[GPTModel]:
    """One GPTModel per virtual pipeline stage held by this rank (one without VPP)."""
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(args),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            rope_scaling=getattr(args, "use_rope_scaling", False),
            rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
            vp_stage=stage,
        ))
    for chunk in chunks:
        fold_mlp_input_biases(chunk)
    return chunks


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
