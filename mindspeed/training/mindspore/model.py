"""The GPT of the torch main job (Megatron-Core GPTModel, local spec) in MindSpore.

embedding (+ learned positions) -> L x [norm -> QKV (column) -> RoPE -> causal attention -> proj (row)
-> residual -> norm -> fc1 (column) -> SwiGLU or GELU -> fc2 (row) -> residual] -> norm -> output
layer (tied or untied); norm is RMSNorm or LayerNorm (with bias); positions are RoPE, a learned
table (--position-embedding-type learned_absolute) or none; linear biases optional (--add-bias-linear,
or q/k/v only: --add-qkv-bias, Qwen2); RoPE optionally with Llama 3.1's frequency scaling
(--use-rope-scaling) -> vocab-parallel cross-entropy; with --num-experts every MLP is Megatron-Core's
MoE layer instead (moe.py: router, experts over the expert-parallel ranks, shared experts). Parameters carry Megatron-Core's state-dict
names and per-TP-rank shapes (see neutral_format for the sharding), so checkpoints move between
backends. RMSNorm, SwiGLU, RoPE and attention run through the backend's kernels (features reach the
model via the interface only); LayerNorm and GELU are MindSpore's own ops (no fused variant here).
Recompute (full by layer chunks, selective around the attention core) is MindSpore's own
(recompute_plan picks the chunks). Per micro-batch the model can take `Extras`: a document mask
(--reset-attention-mask), per-sample positions for the learned table (--reset-position-ids) and
dropout's keep masks (drawn by dropout.py; tensors, so a recomputed forward drops the same values).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import ops

from mindspeed.backends.mindspore import precision
from mindspeed.features.parallel.layers import layer_list, noop_layer_set
from mindspeed.checkpoint import neutral as nf
from mindspeed.training.mindspore.attention_band import CAUSAL, band_keywords
from mindspeed.training.mindspore.moe import MoELayer
from mindspeed.training.mindspore.layers import (column_parallel, row_parallel, vocab_parallel_cross_entropy,
                                                 vocab_parallel_embedding)
from mindspeed.training.mindspore.parallel import ParallelState, stage_layer_counts
from mindspeed.training.mindspore.recompute_plan import layer_chunks


_THIRDS = ops.Split(axis=-1, output_num=3)
_GELU = precision.fp32_compute(lambda h: ops.gelu(h, approximate="none"))
_GATHER = precision.fp32_compute(ops.gather)
# dropout's keep mask (fp32, 1/(1-p) where kept) times the activation; bf16: rounded once, as torch's
_DROPPED = precision.fp32_compute(lambda x, keep: x * keep)


@dataclass(frozen=True)
class Extras:
    """Per-micro-batch model inputs beyond the tokens (all optional)."""
    attention_mask: object = None    # [b, 1, s, s] bool, True = masked out (on top of causal)
    embed_positions: object = None   # [b, s] rows of the learned position table per sample
    hidden_keep: object = None       # [1 + 2 x layers, s_local, b, h]: keep mask / (1 - p); site 0 the
                                     # embedding, then per layer after attention and after the MLP
    probs_keep: object = None        # [layers, b, heads_local, s, s]: the attention probabilities' mask

    NAMES = ("attention_mask", "embed_positions", "hidden_keep", "probs_keep")


NO_EXTRAS = Extras()


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
    recompute_activation_layers: int = 0     # --recompute-activation-function: the first N layers
    recompute_norm_layers: int = 0           # --recompute-norm: the first N layers
    fused_kernels: frozenset = frozenset()   # kernels whose fused feature is on: the device's fast path
    noop_layers: frozenset = frozenset()     # --noop-layers: indices of layers that pass their input through
    pipeline_layers: tuple = ()              # layers per pipeline stage (empty: one stage holds all)
    virtual_chunks: int = 1                  # --num-layers-per-virtual-pipeline-stage: model chunks per stage
    recompute_method: str = "uniform"        # with recompute: uniform groups or the first N layers (recompute_plan)
    recompute_num_layers: int = 1
    recompute_core_attention: bool = False   # --recompute-granularity selective
    swiglu: bool = True                      # --no-swiglu: fc1 -> GELU (exact, Megatron's F.gelu) -> fc2
    normalization: str = "RMSNorm"           # or "LayerNorm" (with bias)
    position_embedding_type: str = "rope"    # or "learned_absolute" (a table added to the embedding), "none"
    max_position_embeddings: int = 0         # rows of the learned table (default: seq_length)
    hidden_dropout: float = 0.0              # after the embedding and in each bias-dropout-add (training only)
    attention_dropout: float = 0.0           # on the attention probabilities (training only)
    params_dtype: str = "fp32"               # --fp16 / --bf16: 16-bit weights and activations, fp32 masters
    num_experts: int = 0                     # --num-experts: every layer's MLP is an MoE layer (moe.py)
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0             # each expert's FFN size (default: --ffn-hidden-size)
    moe_aux_loss_coeff: float = 0.0
    moe_shared_expert_size: int = 0          # --moe-shared-expert-intermediate-size (0: none)
    moe_dispatch: frozenset = frozenset()    # the MOE_DISPATCH features on: how moe.py schedules its exchanges
    attention_band: tuple = CAUSAL           # the attention kernel's mask keywords (attention_band.py)

    # feature id -> the kernels it switches to the device's fast path (the MoE layer's from its own
    # host permutation and per-expert loop to the kernels: moe.py)
    FEATURE_KERNELS = {"fused-rmsnorm": ("rms_norm",), "fused-swiglu": ("swiglu",), "fused-rotary-pos-emb": ("rope",),
                       "flash-attn": ("attention",),
                       "fused-moe-token-permute-and-unpermute": ("moe_permute", "moe_unpermute"),
                       "moe-grouped-gemm": ("gmm",), "gradient-accumulation-fusion": ("matmul_add_fp32",)}
    # feature ids that change the MoE layer's dispatch and combine (moe.py)
    MOE_DISPATCH = ("moe-alltoall-overlap-comm", "moe-permutation-async-comm", "moe-shared-expert-overlap")

    @classmethod
    def from_args(cls, args, padded_vocab: int, features=()) -> "GPTConfig":
        """features: ids of the enabled (adapted) features; fused ones pick the fast kernels."""
        return cls(num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
                   num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                   kv_channels=args.kv_channels, vocab_size=padded_vocab, seq_length=args.seq_length,
                   norm_epsilon=args.norm_epsilon, rotary_base=args.rotary_base,
                   rotary_percent=args.rotary_percent,
                   tied_embeddings=not args.untie_embeddings_and_output_weights,
                   init_method_std=args.init_method_std, recompute=args.recompute_granularity == "full",
                   add_bias_linear=bool(args.add_bias_linear),
                   add_qkv_bias=bool(getattr(args, "add_qkv_bias", False)),
                   rope_scaling_factor=float(args.rope_scaling_factor or 8.0) if getattr(args, "use_rope_scaling", False)
                   else None,
                   recompute_activation_layers=cls._recomputed_layers(args, features, "recompute-activation-function",
                                                                      "recompute_activation_function_num_layers"),
                   recompute_norm_layers=cls._recomputed_layers(args, features, "recompute-norm",
                                                                "recompute_norm_num_layers"),
                   fused_kernels=frozenset(k for f in features for k in cls.FEATURE_KERNELS.get(f, ())),
                   moe_dispatch=frozenset(f for f in features if f in cls.MOE_DISPATCH),
                   noop_layers=noop_layer_set(args),
                   recompute_method=args.recompute_method or "uniform",
                   recompute_num_layers=1 if args.recompute_num_layers is None else args.recompute_num_layers,
                   recompute_core_attention=args.recompute_granularity == "selective",
                   swiglu=bool(args.swiglu), normalization=args.normalization,
                   position_embedding_type=args.position_embedding_type,
                   max_position_embeddings=args.max_position_embeddings or args.seq_length,
                   hidden_dropout=float(args.hidden_dropout or 0.0),
                   attention_dropout=float(args.attention_dropout or 0.0),
                   params_dtype="fp16" if getattr(args, "fp16", False) else "bf16" if getattr(args, "bf16", False)
                   else "fp32",
                   pipeline_layers=cls._pipeline_layers(args),
                   virtual_chunks=cls._virtual_chunks(args),
                   num_experts=getattr(args, "num_experts", None) or 0,
                   moe_router_topk=getattr(args, "moe_router_topk", 2),
                   moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size,
                   moe_aux_loss_coeff=float(getattr(args, "moe_aux_loss_coeff", 0.0) or 0.0),
                   moe_shared_expert_size=getattr(args, "moe_shared_expert_intermediate_size", None) or 0,
                   attention_band=band_keywords(args, features))

    @staticmethod
    def _pipeline_layers(args) -> tuple:
        pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
        if pp == 1:
            return ()
        return tuple(stage_layer_counts(args.num_layers, pp, layer_list(args),
                                        getattr(args, "decoder_first_pipeline_num_layers", None),
                                        getattr(args, "decoder_last_pipeline_num_layers", None)))

    @staticmethod
    def _virtual_chunks(args) -> int:
        per_chunk = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
        if per_chunk is None:
            return 1
        return args.num_layers // args.pipeline_model_parallel_size // per_chunk

    def stage_layers(self, pp_rank: int) -> list:
        """The layer indices pipeline stage pp_rank holds (all of them without PP), chunk by chunk."""
        return [i for c in range(self.virtual_chunks) for i in self.chunk_layers(pp_rank, c)]

    def chunk_layers(self, pp_rank: int, chunk: int) -> range:
        """The layers of model chunk `chunk` on stage pp_rank. With a virtual pipeline (Megatron-Core's
        layout) chunk c of stage r is virtual stage c x PP + r of PP x chunks equal ones; else the
        stage's layers."""
        counts = self.pipeline_layers or (self.num_layers,)
        if self.virtual_chunks > 1:
            per_chunk = counts[0] // self.virtual_chunks
            first = (chunk * len(counts) + pp_rank) * per_chunk
            return range(first, first + per_chunk)
        first = sum(counts[:pp_rank])
        return range(first, first + counts[pp_rank])

    def real_layers(self) -> list[int]:
        """Indices of the layers that compute (the others have no weights and pass through)."""
        return [i for i in range(self.num_layers) if i not in self.noop_layers]

    @staticmethod
    def _recomputed_layers(args, features, feature_id: str, num_layers_dest: str) -> int:
        if feature_id not in features:
            return 0
        return getattr(args, num_layers_dest, None) or args.num_layers

    def _mlp_shapes(self, i: int) -> dict:
        """Layer i's MoE weights: the router, every expert (global index), the shared experts."""
        h, gate = self.hidden_size, 2 if self.swiglu else 1
        shapes = {nf.layer_name(i, "mlp.router.weight"): (self.num_experts, h)}
        for e in range(self.num_experts):
            shapes.update({nf.expert_name(i, e, "linear_fc1.weight"): (gate * self.moe_ffn_hidden_size, h),
                           nf.expert_name(i, e, "linear_fc2.weight"): (h, self.moe_ffn_hidden_size)})
        if self.moe_shared_expert_size:
            shapes.update({nf.layer_name(i, "mlp.shared_experts.linear_fc1.weight"): (gate * self.moe_shared_expert_size, h),
                           nf.layer_name(i, "mlp.shared_experts.linear_fc2.weight"): (h, self.moe_shared_expert_size)})
        return shapes

    def full_shapes(self) -> dict:
        h, d = self.hidden_size, self.kv_channels
        qkv = (self.num_attention_heads + 2 * self.num_query_groups) * d
        fc1 = (2 if self.swiglu else 1) * self.ffn_hidden_size
        shapes = {"embedding.word_embeddings.weight": (self.vocab_size, h)}
        if self.position_embedding_type == "learned_absolute":
            shapes["embedding.position_embeddings.weight"] = (self.max_position_embeddings or self.seq_length, h)
        for i in self.real_layers():
            shapes.update({nf.layer_name(i, "input_layernorm.weight"): (h,),
                           nf.layer_name(i, "self_attention.linear_qkv.weight"): (qkv, h),
                           nf.layer_name(i, "self_attention.linear_proj.weight"): (h, self.num_attention_heads * d),
                           nf.layer_name(i, "pre_mlp_layernorm.weight"): (h,)})
            shapes.update(self._mlp_shapes(i) if self.num_experts else
                          {nf.layer_name(i, "mlp.linear_fc1.weight"): (fc1, h),
                           nf.layer_name(i, "mlp.linear_fc2.weight"): (h, self.ffn_hidden_size)})
            if self.normalization == "LayerNorm":
                shapes.update({nf.layer_name(i, "input_layernorm.bias"): (h,),
                               nf.layer_name(i, "pre_mlp_layernorm.bias"): (h,)})
            if self.add_bias_linear or self.add_qkv_bias:
                shapes[nf.layer_name(i, "self_attention.linear_qkv.bias")] = (qkv,)
            if self.add_bias_linear:
                shapes.update({nf.layer_name(i, "self_attention.linear_proj.bias"): (h,),
                               nf.layer_name(i, "mlp.linear_fc1.bias"): (fc1,),
                               nf.layer_name(i, "mlp.linear_fc2.bias"): (h,)})
        shapes["decoder.final_layernorm.weight"] = (h,)
        if self.normalization == "LayerNorm":
            shapes["decoder.final_layernorm.bias"] = (h,)
        if not self.tied_embeddings:
            shapes["output_layer.weight"] = (self.vocab_size, h)
        return shapes


def init_full_weights(cfg: GPTConfig, seed: int) -> dict:
    """Megatron's init on whole tensors (TP-independent, like use_cpu_initialization): normal(0, std),
    output projections std/sqrt(2L), norms ones."""
    rng = np.random.RandomState(seed)
    scaled = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    weights = {}
    for name, shape in cfg.full_shapes().items():
        if name.endswith("layernorm.weight"):
            weights[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            weights[name] = np.zeros(shape, np.float32)
        else:
            std = scaled if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else cfg.init_method_std
            weights[name] = rng.normal(0.0, std, shape).astype(np.float32)
    return weights


def _set(params: dict, name: str, value) -> None:
    if name in params:
        precision.assign(params[name], value)   # in place: a traced graph holds the storage
    else:
        params[name] = ms.Parameter(value, name=name)


def llama3_scaled_inv_freq(inv_freq: np.ndarray, factor: float, low_freq_factor: float = 1.0,
                           high_freq_factor: float = 4.0, old_context_len: int = 8192) -> np.ndarray:
    """Llama 3.1's RoPE frequency scaling, step for step as Megatron-Core 0.16's
    RotaryEmbedding._apply_scaling computes it in fp32 (only `factor` is a flag there): long
    wavelengths are slowed by `factor`, short ones kept, the band between interpolated."""
    f32 = np.float32
    freqs = inv_freq.astype(f32)
    low_wavelen, high_wavelen = f32(old_context_len / low_freq_factor), f32(old_context_len / high_freq_factor)
    # torch evaluates `scalar / tensor` as reciprocal(tensor) * scalar: the same here, bit for bit
    wavelen = (f32(1) / freqs) * f32(2 * math.pi)
    scaled = np.where(wavelen > low_wavelen, freqs / f32(factor), freqs)
    smooth = ((f32(1) / wavelen) * f32(old_context_len) - f32(low_freq_factor)) / f32(high_freq_factor - low_freq_factor)
    smoothed = (f32(1) - smooth) * scaled / f32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


class GPTModel:
    def __init__(self, cfg: GPTConfig, backend, ps: ParallelState):
        tp = ps.tp_size
        for what, value in (("attention heads", cfg.num_attention_heads), ("query groups", cfg.num_query_groups),
                            ("ffn hidden size", cfg.ffn_hidden_size), ("padded vocab", cfg.vocab_size)):
            if value % tp:
                raise ValueError(f"{what} {value} is not divisible by tensor parallel size {tp}")
        if cfg.num_attention_heads % cfg.num_query_groups:
            raise ValueError(f"{cfg.num_attention_heads} heads are not a multiple of {cfg.num_query_groups} query groups")
        self.cfg, self.backend, self.ps = cfg, backend, ps
        self.params = {}
        # --fp16 / --bf16 (Megatron's Float16Module): the model computes with 16-bit copies of fp32 master
        # weights; the masters are what the optimizer updates and checkpoints hold (empty in fp32). bf16
        # ops without a CPU kernel compute in fp32 (backends/mindspore/precision.py)
        self.dtype = {"fp16": ms.float16, "bf16": ms.bfloat16}.get(cfg.params_dtype, ms.float32)
        self.masters = {}
        self.heads_local = cfg.num_attention_heads // tp
        self.groups_local = cfg.num_query_groups // tp
        self._rope_tables()
        self.cp = None                 # CPGroups when context parallelism is on
        self.cp_attention = None       # the context-parallel feature's attention hook
        self.band = dict(cfg.attention_band)
        self.swap_scope, self.swap_modules = None, frozenset()   # --swap-attention's hook
        # pipeline parallelism: this stage's slice of the layers (Megatron's split)
        self.layers = [i for i in cfg.stage_layers(ps.pp_rank) if i not in cfg.noop_layers]
        self._slot = {layer: pos for pos, layer in enumerate(self.layers)}   # index into the dropout masks
        self.moe_layers = {}
        if cfg.num_experts % ps.ep_size:
            raise ValueError(f"{cfg.num_experts} experts are not divisible by expert parallel size {ps.ep_size}")

    def enable_context_parallel(self, cp_groups, attention_fn) -> None:
        """Route attention through the CP feature (written once against the backend interface)."""
        self.cp, self.cp_attention = cp_groups, attention_fn

    # parameters -----------------------------------------------------------------------------------
    def load_full(self, full: dict) -> None:
        """Set parameters from whole tensors (Megatron names), keeping this TP rank's shard."""
        expected = self.owned_shapes()
        missing = sorted(set(expected) - set(full))
        wrong = [f"{k}: {tuple(full[k].shape)} != {expected[k]}" for k in expected
                 if k in full and tuple(full[k].shape) != tuple(expected[k])]
        if missing or wrong:
            raise ValueError("checkpoint does not fit this model: "
                             + "; ".join(([f"missing {', '.join(missing)}"] if missing else []) + wrong))
        for name in expected:
            shard = nf.shard_for_rank(name, np.asarray(full[name], np.float32), self.ps.tp_rank, self.ps.tp_size,
                                      self.cfg.swiglu)
            if self.dtype != ms.float32:      # the loaded fp32 values are the masters, exactly
                _set(self.masters, name, ms.Tensor(shard))
            _set(self.params, name, ms.Tensor(shard).astype(self.dtype))

    def master_params(self) -> dict:
        """The fp32 weights by name: what the optimizer updates and checkpoints hold (with --fp16 the
        masters, else the parameters themselves)."""
        return self.masters or self.params

    def copy_from_masters(self) -> None:
        """--fp16 / --bf16: the model's weights rounded from the updated masters (Megatron's
        _copy_main_params_to_model_params)."""
        for name, master in self.masters.items():
            precision.assign(self.params[name], master.astype(self.dtype))

    def owned_shapes(self) -> dict:
        """The whole shapes of the parameters this pipeline stage holds (all of them without PP),
        with expert parallelism only this EP rank's experts."""
        return {n: s for n, s in self.stage_shapes(self.cfg, self.ps.pp_rank, self.ps.pp_size).items()
                if not nf.is_expert(n) or self.owns_expert(nf.expert_of(n))}

    def owns_expert(self, e: int) -> bool:
        return nf.expert_owner(e, self.cfg.num_experts, self.ps.ep_size) == self.ps.ep_rank

    @staticmethod
    def stage_shapes(cfg: GPTConfig, pp_rank: int, pp_size: int) -> dict:
        """The whole shapes of the parameters pipeline stage pp_rank (of pp_size) holds."""
        layers = cfg.stage_layers(pp_rank)

        def on_stage(name):
            if name.startswith("decoder.layers."):
                return int(name.split(".")[2]) in layers
            if name in GPTModel.shared_across_stages(cfg, pp_size):
                return pp_rank in (0, pp_size - 1)
            return pp_rank == 0 if name.startswith("embedding.") else pp_rank == pp_size - 1   # norm, output layer
        return {n: s for n, s in cfg.full_shapes().items() if on_stage(n)}

    @staticmethod
    def shared_across_stages(cfg: GPTConfig, pp_size: int) -> tuple:
        """Weights the first and the last pipeline stage both hold: tied word embeddings (the last
        stage's output layer is a copy, kept equal by summing the two stages' gradients, as
        Megatron's embedding group does)."""
        return ("embedding.word_embeddings.weight",) if cfg.tied_embeddings and pp_size > 1 else ()

    def counted_in_grad_norm(self, name: str) -> bool:
        """Whether this rank's gradient of `name` enters the global norm: each element once, as
        Megatron counts it: replicated weights on TP rank 0 only, a weight shared across stages on
        the first stage only."""
        if name in self.shared_across_stages(self.cfg, self.ps.pp_size) and not self.ps.first_stage:
            return False
        return self.is_tp_sharded(name) or self.ps.tp_rank == 0

    def parameters(self) -> list:
        return list(self.params.values())

    def is_tp_sharded(self, name: str) -> bool:
        return nf.split_kind(name, self.cfg.swiglu) != "replicated"

    # forward ---------------------------------------------------------------------------------------
    def _rope_tables(self):
        cfg = self.cfg
        dim = int(cfg.kv_channels * cfg.rotary_percent)
        inv_freq = 1.0 / (cfg.rotary_base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        if cfg.rope_scaling_factor is not None:
            inv_freq = llama3_scaled_inv_freq(inv_freq, cfg.rope_scaling_factor)
        freqs = np.outer(np.arange(cfg.seq_length, dtype=np.float32), inv_freq)
        emb = np.concatenate([freqs, freqs], -1)[:, None, None, :]        # [s, 1, 1, dim], rotate-half
        self.cos, self.sin = ms.Tensor(np.cos(emb)), ms.Tensor(np.sin(emb))

    def kernel(self, name: str):
        """The device's fast path when its fused feature is on, else the reference (the same
        callable on CPU, where the fast path is the reference)."""
        kernels = self.backend.kernels
        # bf16 on CPU: in fp32 (the references widen most ops, not GQA's repeat or every gradient)
        return precision.fp32_compute(getattr(kernels if name in self.cfg.fused_kernels else kernels.reference, name))

    def _norm(self, x, name):
        return self._normalize(x, self.params[name], self._norm_bias(name))

    def _norm_bias(self, weight_name):
        return self.params[weight_name[:-len("weight")] + "bias"] if self.cfg.normalization == "LayerNorm" else None

    def _normalize(self, x, weight, bias=None):
        if self.cfg.normalization == "LayerNorm":     # MindSpore's own LayerNorm (bias and eps as torch's)
            return precision.fp32_compute(ops.LayerNorm(-1, -1, self.cfg.norm_epsilon))(x, weight, bias)[0]
        return self.kernel("rms_norm")(x, weight, self.cfg.norm_epsilon)[0]

    def _recomputed(self, layers: int, i: int, fn, *inputs):
        """fn(*inputs), and a `done(consumer_output)` to call once fn's output has been used:
        with recompute on for layer i, the output is then freed and rebuilt in backward."""
        if i >= layers:
            return fn(*inputs), lambda consumer_output: None
        handle = self.backend.memory.recompute_output(fn, *inputs)
        return handle.output, handle.discard

    def _layer_norm(self, i, x, suffix):
        name = nf.layer_name(i, suffix)
        bias = self._norm_bias(name)
        if bias is not None:
            return self._recomputed(self.cfg.recompute_norm_layers, i, self._normalize, x, self.params[name], bias)
        return self._recomputed(self.cfg.recompute_norm_layers, i, self._normalize, x, self.params[name])

    def _rope_at(self, s, positions):
        if positions is None:
            return self.cos[:s], self.sin[:s]
        return ops.gather(self.cos, positions, 0), ops.gather(self.sin, positions, 0)

    def _attention(self, i, x, positions=None, extras=NO_EXTRAS):
        cfg, rope = self.cfg, self.kernel("rope")
        p = lambda s: self.params[nf.layer_name(i, s)]
        qkv = column_parallel(self.backend, self.ps, x, p("self_attention.linear_qkv.weight"),
                              self._bias(i, "self_attention.linear_qkv.bias"))
        s, b = qkv.shape[0], qkv.shape[1]
        d, per_group = cfg.kv_channels, self.heads_local // self.groups_local
        qkv = qkv.reshape(s, b, self.groups_local, (per_group + 2) * d)
        # one query head per group: equal thirds, MindSpore's Split kernel (ops.split lowers to three
        # StridedSlice on CPU, which is slower)
        q, k, v = _THIRDS(qkv) if per_group == 1 else ops.split(qkv, [per_group * d, d, d], axis=-1)
        if cfg.position_embedding_type == "rope":
            cos, sin = self._rope_at(s, positions)
            q = rope(q.reshape(s, b, self.heads_local, d), cos, sin, 0)
            k = rope(k, cos, sin, 0)
        q, k, v = q.reshape(s, b, -1), k.reshape(s, b, -1), v.reshape(s, b, -1)
        core = lambda q, k, v: self._core_attention(q, k, v, i, extras)
        if cfg.recompute_core_attention:     # selective recompute: only q, k, v are kept for backward
            out = self.backend.memory.recompute(core, q, k, v)
        else:
            out = core(q, k, v)
        return row_parallel(self.backend, self.ps, out, p("self_attention.linear_proj.weight"),
                            self._bias(i, "self_attention.linear_proj.bias"))

    def _attention_block(self, x, i, positions, extras):
        """bf16 on CPU: the block in fp32 on bf16 weights, its output rounded once (the q/k/v split's
        gradient, GQA's repeat and the softmax have no bf16 CPU kernel)."""
        return precision.fp32_compute(lambda h: self._attention(i, h, positions, extras))(x)

    def _core_attention(self, q, k, v, i=0, extras=NO_EXTRAS):
        if self.cp is not None:      # this rank holds a shard of the sequence
            # --attention-mask-type general: the batch's own mask over the whole sequence (the documents'
            # mask, which holds the causal one); else Megatron's causal mask, implicit
            whole = {} if extras.attention_mask is None else {"mask": extras.attention_mask}
            return self.cp_attention(q, k, v, self.cp, head_num=self.heads_local, causal=True, **whole)
        if extras.probs_keep is not None:   # an explicit drop mask: the reference kernel takes one
            return precision.fp32_compute(self.backend.kernels.reference.attention)(
                q, k, v, layout="SBH", head_num=self.heads_local, mask=extras.attention_mask,
                drop_mask=extras.probs_keep[self._slot[i]], **self.band)[0]
        document_mask = {} if extras.attention_mask is None else {"mask": extras.attention_mask}
        return self.kernel("attention")(q, k, v, layout="SBH", head_num=self.heads_local, **self.band,
                                        **document_mask)[0]

    def _activation(self, h):
        if self.cfg.swiglu:
            return self.kernel("swiglu")(h, -1)
        return _GELU(h)       # Megatron-Core's default activation_func, F.gelu

    def _mlp(self, i, x):
        if self.cfg.num_experts:
            if i not in self.moe_layers:
                self.moe_layers[i] = MoELayer(self, i)
            return precision.fp32_compute(self.moe_layers[i])(x)     # bf16 on CPU: the layer in fp32
        p = lambda s: self.params[nf.layer_name(i, s)]
        h = column_parallel(self.backend, self.ps, x, p("mlp.linear_fc1.weight"), self._bias(i, "mlp.linear_fc1.bias"))
        act, done = self._recomputed(self.cfg.recompute_activation_layers, i, self._activation, h)
        out = row_parallel(self.backend, self.ps, act, p("mlp.linear_fc2.weight"), self._bias(i, "mlp.linear_fc2.bias"))
        done(out)
        return out

    def _bias(self, i, suffix):
        on = self.cfg.add_bias_linear or (self.cfg.add_qkv_bias and suffix == "self_attention.linear_qkv.bias")
        return self.params[nf.layer_name(i, suffix)] if on else None

    def enable_activation_swap(self, scope, modules) -> None:
        """--swap-attention: the named parts of each layer run inside scope(layer number), so what they
        save for backward waits in host memory (features/memory/activation_swap.py)."""
        self.swap_scope, self.swap_modules = scope, frozenset(modules)

    def _part(self, name, i, fn, *args):
        if self.swap_scope is None or name not in self.swap_modules:
            return fn(*args)
        with self.swap_scope(i + 1):        # Megatron's layer numbers start at 1
            return fn(*args)

    def _dropped(self, x, extras, site):
        """Dropout at one site of the hidden stream (Megatron's embedding dropout and bias-dropout-add)."""
        return x if extras.hidden_keep is None else _DROPPED(x, extras.hidden_keep[site])

    def _layer(self, i, x, positions=None, extras=NO_EXTRAS):
        # each part inside its --swap-attention scope when named; norms and the activation through
        # --recompute-norm / --recompute-activation-function (done(consumer) frees their output)
        normed, done = self._part("input_layernorm", i, self._layer_norm, i, x, "input_layernorm.weight")
        attn = self._part("self_attention", i, self._attention_block, normed, i, positions, extras)
        done(attn)
        x = x + self._dropped(attn, extras, 1 + 2 * self._slot[i])
        normed, done = self._part("pre_mlp_layernorm", i, self._layer_norm, i, x, "pre_mlp_layernorm.weight")
        mlp = self._part("mlp", i, self._mlp, i, normed)
        done(mlp)
        return x + self._dropped(mlp, extras, 2 + 2 * self._slot[i])

    def _layers(self, layers, x, positions, extras=NO_EXTRAS):
        for i in layers:
            x = self._layer(i, x, positions, extras)
        return x

    def _position_embedding(self, s_local, positions, per_sample=None):
        """[s_local, 1 or b, h] rows of the learned table for this rank's tokens: its CP positions (or
        per_sample [b, s], --reset-position-ids), and with sequence parallelism its TP rank's slice
        (the table's gradient is summed over TP then)."""
        table = self.params["embedding.position_embeddings.weight"]
        ps = self.ps
        sp_split = ps.sequence_parallel and ps.tp_size > 1
        rows = s_local * ps.tp_size if sp_split else s_local
        if per_sample is not None:
            rows_emb = _GATHER(table, per_sample.T, 0)          # [s, b, h]
        else:
            rows_emb = (table[:rows] if positions is None else _GATHER(table, positions, 0)).expand_dims(1)
        if sp_split:
            rows_emb = rows_emb[ps.tp_rank * s_local:(ps.tp_rank + 1) * s_local]
        return rows_emb

    def logits(self, tokens, position_ids=None, extras=NO_EXTRAS):
        """tokens [b, s] -> this rank's vocab shard of the logits [s, b, V/tp]. position_ids [b, s]
        (the same in every row) place RoPE when the sequence is sharded by context parallelism."""
        positions = None if position_ids is None else position_ids[0]
        return self._head(self._decoder(self._embed(tokens, positions, extras), positions, extras))

    def _embed(self, tokens, positions=None, extras=NO_EXTRAS):
        x = vocab_parallel_embedding(self.backend, self.ps, tokens, self.params["embedding.word_embeddings.weight"])
        if self.cfg.position_embedding_type == "learned_absolute":
            x = x + self._position_embedding(x.shape[0], positions, extras.embed_positions)
        return self._dropped(x, extras, 0)

    def chunk_layers(self, chunk: int) -> list:
        """The layers (with weights) of this stage's model chunk `chunk` (virtual pipeline)."""
        return [i for i in self.cfg.chunk_layers(self.ps.pp_rank, chunk) if i not in self.cfg.noop_layers]

    def _decoder(self, x, positions=None, extras=NO_EXTRAS, layers=None):
        """This pipeline stage's layers (`layers`: one model chunk's), recomputed as Megatron's
        TransformerBlock does within each chunk."""
        method = self.cfg.recompute_method if self.cfg.recompute else None
        for layers, recomputed in layer_chunks(self.layers if layers is None else layers, method,
                                               self.cfg.recompute_num_layers):
            if recomputed:     # one chunk: only its input is kept, its layers rerun in backward
                x = self.backend.memory.recompute(lambda h, ls=layers: self._layers(ls, h, positions, extras), x)
            else:
                x = self._layers(layers, x, positions, extras)
        return x

    def _head(self, x):
        x = self._norm(x, "decoder.final_layernorm.weight")
        out_w = self.params["embedding.word_embeddings.weight" if self.cfg.tied_embeddings else "output_layer.weight"]
        return column_parallel(self.backend, self.ps, x, out_w)

    def loss(self, tokens, labels, loss_mask, position_ids=None, denominator=None, extras=NO_EXTRAS):
        """Mean cross-entropy over the tokens loss_mask keeps (Megatron's lm loss). With context
        parallelism, `denominator` is the kept-token count of the whole sequence, so the CP ranks'
        losses (and gradients) sum to the full-sequence ones."""
        return self._masked_mean(self.logits(tokens, position_ids, extras), labels, loss_mask, denominator)

    def stage_forward(self, hidden, tokens, labels, loss_mask, chunk: int = 0):
        """One pipeline stage's model chunk `chunk` (the stage itself without a virtual pipeline): the
        embedding of `tokens` on the first stage's first chunk, else the previous (virtual) stage's
        output `hidden` [s, b, h], through the chunk's layers -> the loss on the last stage's last
        chunk, else the activation for the next one."""
        first = self.ps.first_stage and chunk == 0
        last = self.ps.last_stage and chunk == self.cfg.virtual_chunks - 1
        x = self._decoder(self._embed(tokens) if first else hidden, layers=self.chunk_layers(chunk))
        return self._masked_mean(self._head(x), labels, loss_mask) if last else x

    def _masked_mean(self, logits, labels, loss_mask, denominator=None):
        per_token = vocab_parallel_cross_entropy(self.backend, self.ps, logits, labels.T)   # [s, b]
        mask = loss_mask.T.astype(ms.float32)
        return (per_token * mask).sum() / (mask.sum() if denominator is None else denominator)
