"""What the MindSpore GPT is: its sizes and switches, read from the trainer's flags and the enabled
features (GPTConfig.from_args), and the pipeline's stage arithmetic: which layers a pipeline stage,
or a model chunk of a virtual pipeline, holds (Megatron-Core's split)."""
from __future__ import annotations

from dataclasses import dataclass

from mindspeed.flags.family_flags import moe_layer_pattern, yarn_settings
from mindspeed.features.parallel.layers import layer_list, noop_layer_set
from mindspeed.features.parallel.unaligned_pipeline import layer_matrix
from mindspeed.features.registry import fast_kernels
from mindspeed.training.mindspore import param_layout
from mindspeed.training.mindspore.attention_band import CAUSAL, band_keywords
from mindspeed.training.mindspore.mla_layout import MLASizes
from mindspeed.training.mindspore.parallel import stage_layer_counts
from mindspeed.training.mindspore.router_settings import SOFTMAX_TOPK, RouterSettings


@dataclass(frozen=True)
class GPTConfig:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int              # padded
    seq_length: int
    norm_epsilon: float = 1e-5
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    tied_embeddings: bool = True
    init_method_std: float = 0.02
    recompute: bool = False
    add_bias_linear: bool = False
    add_qkv_bias: bool = False               # --add-qkv-bias: biases on linear_qkv only (Qwen2)
    rope_scaling_factor: float | None = None  # --use-rope-scaling: Llama 3.1's frequency scaling
    yarn: tuple = ()                         # YaRN scaling: ((setting, value), ...) of family_flags.yarn_settings
    recompute_activation_layers: int = 0     # --recompute-activation-function: the first N layers
    recompute_norm_layers: int = 0           # --recompute-norm: the first N layers
    fused_kernels: frozenset = frozenset()   # kernels whose fused feature is on: the device's fast path
    noop_layers: frozenset = frozenset()     # --noop-layers: indices of layers that pass their input through
    pipeline_layers: tuple = ()              # layers per pipeline stage (empty: one stage holds all)
    virtual_chunks: int = 1                  # --num-layers-per-virtual-pipeline-stage: model chunks per stage
    chunk_counts: tuple = ()                 # unaligned pipeline: layers of each virtual stage v x PP + r (Megatron's order)
    recompute_method: str = "uniform"        # with recompute: uniform groups or the first N layers (recompute_plan)
    recompute_num_layers: int = 1
    recompute_core_attention: bool = False   # --recompute-granularity selective
    swiglu: bool = True                      # --no-swiglu: fc1 -> GELU (exact, Megatron's F.gelu) -> fc2
    normalization: str = "RMSNorm"           # or "LayerNorm" (with bias)
    qk_layernorm: bool = False               # --qk-layernorm: per-head q/k norms (Qwen3), weights [kv_channels]
                                             # (with MLA: the compressed q's and kv's norms)
    mla: MLASizes | None = None              # --multi-latent-attention's sizes (mla_layout.py; None: plain attention)
    mtp_num_layers: int = 0                  # --mtp-num-layers: MTP layers after the decoder (mtp.py)
    mtp_loss_scaling_factor: float = 0.1     # --mtp-loss-scaling-factor: their loss's weight in the gradient
    position_embedding_type: str = "rope"    # or "learned_absolute" (a table added to the embedding), "none"
    max_position_embeddings: int = 0         # rows of the learned table (default: seq_length)
    hidden_dropout: float = 0.0              # after the embedding and in each bias-dropout-add (training only)
    attention_dropout: float = 0.0           # on the attention probabilities (training only)
    params_dtype: str = "fp32"               # --fp16 / --bf16: 16-bit weights and activations, fp32 masters
    reuse_fp32_param: bool = False           # --reuse-fp32-param: bf16 masters folded as (weight, residual) halves
    num_experts: int = 0                     # --num-experts: the MoE layers' MLP is an MoE layer (moe.py)
    dense_layers: frozenset = frozenset()    # with --num-experts, the layers whose MLP stays dense (--moe-layer-freq,
                                             # --first-k-dense-replace: Megatron-Core's moe_layer_freq pattern)
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0             # each expert's FFN size (default: --ffn-hidden-size)
    moe_aux_loss_coeff: float = 0.0
    moe_router: RouterSettings = SOFTMAX_TOPK  # the router's score function, groups, scaling, load balancing
    moe_shared_expert_size: int = 0          # --moe-shared-expert-intermediate-size (0: none)
    moe_dispatch: frozenset = frozenset()    # the MOE_DISPATCH features on: how moe.py schedules its exchanges
    moe_allgather: bool = False              # --moe-token-dispatcher-type allgather (else alltoall)
    experts_tp_sharded: bool = False         # TP > 1 without --moe-tp-extend-ep: every expert split over TP (Megatron-Core's
                                             # expert_tensor_parallel_size = TP), its tokens all-gathered over TP (moe.py)
    expert_main_grads: bool = False          # --gemm-gradient-accumulation-fusion: grouped experts' fp32 main grads
    attention_band: tuple = CAUSAL           # the attention kernel's mask keywords (attention_band.py)

    # feature ids that change the MoE layer's dispatch and combine (moe.py)
    MOE_DISPATCH = ("moe-alltoall-overlap-comm", "moe-permutation-async-comm", "moe-shared-expert-overlap")

    @classmethod
    def from_args(cls, args, padded_vocab: int, features=()) -> "GPTConfig":
        """features: ids of the enabled (adapted) features; fused ones pick the fast kernels."""
        return cls(**_architecture(args, padded_vocab), **_positions(args), **_recompute(args, features),
                   **_training(args, features), **_pipeline(args), **_moe(args, features, cls.MOE_DISPATCH),
                   fused_kernels=fast_kernels(features),     # each feature declares its own (Feature.kernels)
                   attention_band=band_keywords(args, features))

    # pipeline stages -------------------------------------------------------------------------------
    def stage_layers(self, pp_rank: int) -> list:
        """The layer indices pipeline stage pp_rank holds (all of them without PP), chunk by chunk."""
        return [i for c in range(self.virtual_chunks) for i in self.chunk_layers(pp_rank, c)]

    def chunk_layers(self, pp_rank: int, chunk: int) -> range:
        """The layers of model chunk `chunk` on stage pp_rank. With a virtual pipeline (Megatron-Core's
        layout) chunk c of stage r is virtual stage c x PP + r of PP x chunks equal ones; else the
        stage's layers."""
        counts = self.pipeline_layers or (self.num_layers,)
        if self.chunk_counts:
            stage = chunk * len(counts) + pp_rank
            first = sum(self.chunk_counts[:stage])
            return range(first, first + self.chunk_counts[stage])
        if self.virtual_chunks > 1:
            per_chunk = counts[0] // self.virtual_chunks
            first = (chunk * len(counts) + pp_rank) * per_chunk
            return range(first, first + per_chunk)
        first = sum(counts[:pp_rank])
        return range(first, first + counts[pp_rank])

    def real_layers(self) -> list[int]:
        """Indices of the layers that compute (the others have no weights and pass through)."""
        return [i for i in range(self.num_layers) if i not in self.noop_layers]

    def is_moe(self, i: int) -> bool:
        """Whether layer i (global index)'s MLP is an MoE layer. An MTP layer (i >= num_layers) is
        the decoder's last layer's kind (Megatron-Core's get_gpt_mtp_block_spec takes its spec)."""
        return bool(self.num_experts) and min(i, self.num_layers - 1) not in self.dense_layers

    def moe_layers(self) -> list[int]:
        """The global indices of the MoE layers: the decoder's, then the MTP layers' (mtp.py)."""
        return [i for i in range(self.num_layers + self.mtp_num_layers) if self.is_moe(i)]

    @property
    def rope_head_dim(self) -> int:
        """The channels of a head that RoPE's tables cover (before --rotary-percent): MLA's positional part."""
        return self.mla.qk_pos_emb_head_dim if self.mla else self.kv_channels

    def full_shapes(self) -> dict:
        """Every parameter's whole (unsharded) shape by Megatron-Core name (param_layout.py)."""
        return param_layout.full_shapes(self)


# from_args, one group of fields at a time -----------------------------------------------------------
def _architecture(args, padded_vocab: int) -> dict:
    """The sizes and the layer's shape: norm, activation, biases, tied output layer, no-op layers."""
    return dict(num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
                num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                kv_channels=args.kv_channels, vocab_size=padded_vocab, seq_length=args.seq_length,
                norm_epsilon=args.norm_epsilon, tied_embeddings=not args.untie_embeddings_and_output_weights,
                init_method_std=args.init_method_std, add_bias_linear=bool(args.add_bias_linear),
                add_qkv_bias=bool(args.add_qkv_bias), swiglu=bool(args.swiglu),
                normalization=args.normalization, qk_layernorm=bool(args.qk_layernorm),
                mla=MLASizes.from_args(args), noop_layers=noop_layer_set(args),
                mtp_num_layers=args.mtp_num_layers or 0, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)


def _positions(args) -> dict:
    """RoPE (base, share of the head, Llama 3.1's or YaRN's scaling) or a learned table, or none."""
    scaled = args.use_rope_scaling
    return dict(rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
                rope_scaling_factor=float(args.rope_scaling_factor or 8.0) if scaled else None,
                yarn=tuple(sorted(yarn_settings(args).items())) if getattr(args, "yarn", False) else (),
                position_embedding_type=args.position_embedding_type,
                max_position_embeddings=args.max_position_embeddings or args.seq_length)


def _recompute(args, features) -> dict:
    """Full (by layer chunks) or selective recompute from the flags; norm and activation recompute
    from their features."""
    return dict(recompute=args.recompute_granularity == "full",
                recompute_activation_layers=_recomputed_layers(args, features, "recompute-activation-function",
                                                               "recompute_activation_function_num_layers"),
                recompute_norm_layers=_recomputed_layers(args, features, "recompute-norm", "recompute_norm_num_layers"),
                recompute_method=args.recompute_method or "uniform",
                recompute_num_layers=1 if args.recompute_num_layers is None else args.recompute_num_layers,
                recompute_core_attention=args.recompute_granularity == "selective")


def _recomputed_layers(args, features, feature_id: str, num_layers_dest: str) -> int:
    if feature_id not in features:
        return 0
    return getattr(args, num_layers_dest) or args.num_layers


def _training(args, features) -> dict:
    """Dropout, the weights' dtype and how their fp32 masters are kept."""
    dtype = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    return dict(hidden_dropout=float(args.hidden_dropout or 0.0), attention_dropout=float(args.attention_dropout or 0.0),
                params_dtype=dtype, reuse_fp32_param="reuse-fp32-param" in features)


def _pipeline(args) -> dict:
    """Layers per pipeline stage (Megatron's split, uneven first/last stages included) and model
    chunks per stage; the unaligned pipeline's matrix gives each virtual stage's layers."""
    rows = layer_matrix(args)
    if rows is not None and len(rows) > 1:
        return dict(pipeline_layers=tuple(map(sum, rows)), virtual_chunks=len(rows[0]),
                    chunk_counts=tuple(row[v] for v in range(len(rows[0])) for row in rows))
    return dict(pipeline_layers=_pipeline_layers(args), virtual_chunks=_virtual_chunks(args))


def _pipeline_layers(args) -> tuple:
    pp = args.pipeline_model_parallel_size or 1
    if pp == 1:
        return ()
    return tuple(stage_layer_counts(args.num_layers, pp, layer_list(args),
                                    args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers))


def _virtual_chunks(args) -> int:
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    if per_chunk is None:
        return 1
    return args.num_layers // args.pipeline_model_parallel_size // per_chunk


def _moe(args, features, dispatch_features: tuple) -> dict:
    """--num-experts and the MoE layer's settings; the dispatch features on (moe.py)."""
    pattern = moe_layer_pattern(args)
    return dict(num_experts=args.num_experts or 0, moe_router_topk=args.moe_router_topk,
                dense_layers=frozenset(i for i, moe in enumerate(pattern or ()) if not moe),
                moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
                moe_aux_loss_coeff=float(args.moe_aux_loss_coeff or 0.0),
                moe_router=RouterSettings.from_args(args),
                moe_shared_expert_size=args.moe_shared_expert_intermediate_size or 0,
                moe_dispatch=frozenset(f for f in features if f in dispatch_features),
                moe_allgather=args.moe_token_dispatcher_type == "allgather",
                experts_tp_sharded=bool(args.num_experts) and (args.tensor_model_parallel_size or 1) > 1
                and not args.moe_tp_extend_ep,
                expert_main_grads="moe-grouped-gemm" in features
                and bool(getattr(args, "gemm_gradient_accumulation_fusion", False)))
