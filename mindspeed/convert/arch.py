"""The architecture of a Llama-family model, read from a Hugging Face config.json and checked
against the converter's flags; also the trainer flags that rebuild the same model.

Supported (--model-type-hf, config.json model_type):
- llama2 / llama3: Llama 2/3/3.1 ("llama", Llama 3.1's RoPE scaling too) and Qwen2/2.5 ("qwen2", with
  --add-qkv-bias, as MindSpeed-LLM's guides for Qwen2.5 ask); qwen2: Qwen2 only.
- qwen25: Qwen2.5 ("qwen2"): the Llama layout with q/k/v biases (always there: no --add-qkv-bias needed).
- qwen3: Qwen3 ("qwen3"): per-head q/k RMSNorms (the trainer's --qk-layernorm), head_dim of its own
  (--kv-channels), no biases.
- qwen3-moe: Qwen3-MoE ("qwen3_moe"): Qwen3's attention, MoE layers (softmax router, top-k, renormalized
  when norm_topk_prob) where decoder_sparse_step / mlp_only_layers put them, dense SwiGLU elsewhere.
- mixtral: Mixtral ("mixtral"): the Llama attention, every layer MoE (softmax, top-k, renormalized).
- deepseek3: DeepSeek-V3 ("deepseek_v3"): multi-latent attention (YaRN RoPE), the first
  first_k_dense_replace layers dense, then MoE with a sigmoid router (e_score_correction_bias: Megatron-Core's
  expert bias; n_group / topk_group; routed_scaling_factor) and shared experts; its multi-token-prediction
  layers (model.layers.<num_hidden_layers + j>, which transformers drops on load) where the weights have them.
All: RMSNorm, SwiGLU, RoPE (plain, or Llama 3.1's scaling), tied or untied embeddings, GQA.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

from mindspeed.errors import ConvertError

# --model-type-hf -> the config.json model_types it converts
HF_MODEL_TYPES = {"llama2": ("llama", "qwen2"), "llama3": ("llama", "qwen2"), "qwen2": ("qwen2",),
                  "qwen25": ("qwen2",), "qwen3": ("qwen3",), "qwen3-moe": ("qwen3_moe",), "mixtral": ("mixtral",),
                  "deepseek3": ("deepseek_v3",)}
# what each config.json model_type is converted as (the layer layout and its extras)
FAMILIES = {"llama": "llama", "qwen2": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
            "deepseek_v3": "deepseek_v3"}
# the --model-type-hf that suits each model_type best (named in a mismatch refusal)
SUGGESTED = {"llama": "llama2", "qwen2": "qwen25", "qwen3": "qwen3", "qwen3_moe": "qwen3-moe", "mixtral": "mixtral",
             "deepseek_v3": "deepseek3"}
# model types whose q/k/v biases follow from the family (--add-qkv-bias only for llama2/llama3/qwen2)
QKV_BIAS = {"qwen25": True, "qwen3": False, "qwen3-moe": False, "mixtral": False, "deepseek3": False}


@dataclasses.dataclass(frozen=True)
class Arch:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    norm_epsilon: float
    rope_theta: float
    rope_scaling_factor: float | None   # Llama 3.1's frequency scaling, None without
    tied_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    family: str = "llama"                  # FAMILIES' values: the layer layout
    qk_layernorm: bool = False             # per-head q/k RMSNorms (Qwen3)
    num_experts: int = 0                   # 0: dense
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[int, ...] = ()       # 1 for each MoE layer, 0 for each dense one
    norm_topk_prob: bool = True            # the top-k routing weights renormalized to sum to 1
    moe_aux_loss_coeff: float | None = None
    # DeepSeek-V3: multi-latent attention (q_lora_rank or None, kv_lora_rank, qk_nope_head_dim,
    # qk_rope_head_dim, v_head_dim), YaRN's settings, the sigmoid router's extras, shared experts, MTP
    mla: tuple | None = None
    yarn: tuple | None = None              # ((name, value), ...) of YARN_FLAGS' names
    router_sigmoid: bool = False           # sigmoid scores with a per-expert bias (e_score_correction_bias)
    moe_groups: tuple[int, int] | None = None     # (n_group, topk_group)
    routed_scaling_factor: float | None = None
    shared_expert_ffn: int = 0
    mtp_layers: int = 0                    # multi-token-prediction layers (their weights: layers num_layers..)

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (an MTP layer for i >= num_layers, MoE as the last decoder layer) is an MoE layer."""
        return bool(self.num_experts) and bool(self.moe_layers[min(i, self.num_layers - 1)])

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def trainer_flags(self) -> list[str]:
        """The built-in trainer's flags for this model (data/tokenizer flags are the user's)."""
        flags = ["--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
                 "--ffn-hidden-size", str(self.ffn_hidden_size),
                 "--num-attention-heads", str(self.num_heads),
                 "--position-embedding-type", "rope", "--rotary-base", str(int(self.rope_theta)),
                 "--normalization", "RMSNorm", "--norm-epsilon", repr(self.norm_epsilon),
                 "--swiglu", "--disable-bias-linear"]
        if self.mla is None:
            flags[8:8] = ["--group-query-attention", "--num-query-groups", str(self.num_kv_heads),
                          "--kv-channels", str(self.head_dim)]
        else:
            q_rank, kv_rank, nope, rope, v = self.mla
            flags += ["--multi-latent-attention", "--kv-lora-rank", str(kv_rank), "--qk-head-dim", str(nope),
                      "--qk-pos-emb-head-dim", str(rope), "--v-head-dim", str(v)]
            flags += ["--q-lora-rank", str(q_rank)] if q_rank is not None else []
        if self.yarn is not None:
            flags += ["--rope-scaling-type", "yarn"]
            for name, value in self.yarn:
                flags += [YARN_FLAGS[name], repr(value)]
        if self.rope_scaling_factor is not None:
            flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(self.rope_scaling_factor)]
        if self.qkv_bias:
            flags.append("--add-qkv-bias")
        if not self.tied_embeddings:
            flags.append("--untie-embeddings-and-output-weights")
        if self.qk_layernorm:
            flags.append("--qk-layernorm")
        if self.num_experts:
            flags += ["--num-experts", str(self.num_experts), "--moe-router-topk", str(self.moe_topk),
                      "--moe-ffn-hidden-size", str(self.moe_ffn_hidden_size)]
            if not all(self.moe_layers):
                flags += ["--moe-layer-freq", layer_pattern_text(self.moe_layers)]
            # Megatron-Core's default routing (top-k of the logits, softmax over those) is softmax ->
            # top-k -> renormalize; without renormalizing it is softmax over all experts first
            flags.append("--norm-topk-prob" if self.norm_topk_prob else "--moe-router-pre-softmax")
            if self.router_sigmoid:     # DeepSeek-V3's router, computed in fp32 as transformers does
                flags += ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                          "--moe-router-dtype", "fp32"]
            if self.moe_groups is not None:
                flags += ["--moe-router-num-groups", str(self.moe_groups[0]),
                          "--moe-router-group-topk", str(self.moe_groups[1])]
            if self.routed_scaling_factor is not None:
                flags += ["--moe-router-topk-scaling-factor", repr(self.routed_scaling_factor)]
            if self.shared_expert_ffn:
                flags += ["--moe-shared-expert-intermediate-size", str(self.shared_expert_ffn)]
            if self.moe_aux_loss_coeff:
                flags += ["--moe-router-load-balancing-type", "aux_loss",
                          "--moe-aux-loss-coeff", repr(self.moe_aux_loss_coeff)]
            else:
                flags += ["--moe-router-load-balancing-type", "none"]
        if self.mtp_layers:
            flags += ["--mtp-num-layers", str(self.mtp_layers)]
        return flags


# YaRN's config.json fields -> the trainer's flags (MindSpeed-LLM's spellings)
YARN_FLAGS = {"factor": "--rope-scaling-factor", "beta_fast": "--beta-fast", "beta_slow": "--beta-slow",
              "mscale": "--rope-scaling-mscale", "mscale_all_dim": "--rope-scaling-mscale-all-dim",
              "original_max_position_embeddings": "--rope-scaling-original-max-position-embeddings"}


def layer_pattern_text(pattern) -> str:
    """A 0/1 list per layer as Megatron's --moe-layer-freq writes it: "([0]*3+[1]*29)"."""
    runs: list[list[int]] = []
    for p in pattern:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return "(" + "+".join(f"[{p}]*{n}" for p, n in runs) + ")"


def read_config(hf_dir: str, flag: str = "--load-dir") -> dict:
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConvertError(f"{path} is missing: {flag} must be a Hugging Face model directory") from None
    except (OSError, ValueError) as err:
        raise ConvertError(f"{path} is not readable JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConvertError(f"{path} is not a Hugging Face config (not a JSON object)")
    return config


# Llama 3.1's RoPE scaling as Megatron-Core implements it: only `factor` is a parameter there
LLAMA3_SCALING_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_params(config: dict) -> tuple[str, dict]:
    """(RoPE type, its parameters): transformers 5 writes rope_parameters; older configs (and the Hub's)
    have rope_theta and rope_scaling."""
    params = dict(config.get("rope_scaling") or {}, **(config.get("rope_parameters") or {}))
    return params.get("rope_type") or params.get("type") or "default", params


def _yarn(config: dict) -> tuple | None:
    """The YaRN settings (Megatron-Core's YarnRotaryEmbedding for a dense model, multi-latent attention's for
    DeepSeek-V3) as Arch.yarn, None for another scaling or none."""
    kind, params = _rope_params(config)
    if kind != "yarn":
        return None
    if params.get("truncate") is False:
        raise ConvertError("config.json's YaRN has truncate false: Megatron-Core rounds the correction range "
                           "(transformers' truncate true)")
    _check_attention_factor(params)
    values = {name: params.get(name) for name in YARN_FLAGS}
    if values["original_max_position_embeddings"] is None:
        values["original_max_position_embeddings"] = config.get("original_max_position_embeddings")
    return tuple((name, float(v) if name != "original_max_position_embeddings" else int(v))
                 for name, v in values.items() if v is not None)


def _check_attention_factor(params: dict) -> None:
    """transformers scales cos/sin by attention_factor, else get_mscale(factor, mscale) / get_mscale(factor,
    mscale_all_dim) when both are given, else get_mscale(factor); Megatron-Core by the ratio, its mscale 1 and
    mscale_all_dim 0 by default (the same get_mscale(factor)). What the two would compute apart is refused."""
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not all_dim and mscale not in (None, 1, 1.0):
        raise ConvertError(f"config.json's YaRN has mscale {mscale} without mscale_all_dim: transformers ignores it, "
                           "Megatron-Core would not; give mscale_all_dim or drop mscale")
    if params.get("attention_factor") is not None:
        factor = float(params["factor"])
        ratio = (_get_mscale(factor, mscale) / _get_mscale(factor, all_dim)) if mscale and all_dim \
            else _get_mscale(factor)
        if abs(float(params["attention_factor"]) - ratio) > 1e-12:
            raise ConvertError(f"config.json's YaRN sets attention_factor {params['attention_factor']}: Megatron-Core "
                               f"computes it from factor, mscale and mscale_all_dim ({ratio}); drop it or match it")


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope(config: dict) -> tuple[float, float | None]:
    """(rope_theta, Llama 3.1 scaling factor or None; YaRN is Arch.yarn)."""
    kind, params = _rope_params(config)
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise ConvertError(f"config.json rope_theta {theta} is not an integer (the trainer's --rotary-base is)")
    if kind in ("default", "yarn"):
        return float(theta), None
    fixed = {k: params.get(k) for k in LLAMA3_SCALING_FIXED}
    if kind != "llama3" or any(fixed[k] is None or float(fixed[k]) != v for k, v in LLAMA3_SCALING_FIXED.items()):
        raise ConvertError(f"config.json asks for RoPE scaling {kind!r} {fixed}: only unscaled RoPE, YaRN and Llama "
                           f"3.1's 'llama3' scaling with {LLAMA3_SCALING_FIXED} convert (the trainer has only those)")
    return float(theta), float(params["factor"])


def arch_from_config(config: dict, model_type_hf: str, add_qkv_bias: bool) -> Arch:
    """The Arch of `config`, refusing what the flags contradict or the trainer cannot build."""
    try:
        return _arch(config, model_type_hf, add_qkv_bias)
    except KeyError as err:
        raise ConvertError(f"config.json has no {err.args[0]!r}: not a Llama-family config") from None
    except ConvertError:
        raise   # already says what is wrong (ConvertError is a ValueError)
    except (TypeError, ValueError) as err:
        raise ConvertError(f"config.json has a value of the wrong type ({err})") from None


def _arch(config: dict, model_type_hf: str, add_qkv_bias: bool) -> Arch:
    want = HF_MODEL_TYPES[model_type_hf]
    got = config.get("model_type")
    if got not in want:
        archs = config.get("architectures")
        named = f" ({', '.join(map(str, archs))})" if isinstance(archs, list) and archs else ""
        layout = "does not match" if got in SUGGESTED else "is not a model type this converter knows"
        hint = (f" (convert it with --model-type-hf {SUGGESTED[got]})" if got in SUGGESTED else
                f" (it knows {', '.join(map(repr, sorted(SUGGESTED)))})")
        raise ConvertError(f"config.json model_type {got!r}{named} {layout}: --model-type-hf {model_type_hf} "
                           f"converts model_type {' or '.join(map(repr, want))}{hint}")
    family = FAMILIES[got]
    if model_type_hf in QKV_BIAS:
        if add_qkv_bias and not QKV_BIAS[model_type_hf]:
            raise ConvertError(f"--add-qkv-bias: a {model_type_hf} model has no q/k/v biases; drop it")
        add_qkv_bias = QKV_BIAS[model_type_hf]
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConvertError(f"config.json hidden_act {act!r}: only SwiGLU (silu) MLPs convert")
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []) \
            or (family == "mixtral" and config.get("sliding_window") is not None
                and int(config["sliding_window"]) < int(config.get("max_position_embeddings", 4096))):
        raise ConvertError("config.json uses sliding-window attention: the trainer attends over the whole "
                           "sequence, so such a model does not convert")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ConvertError(f"config.json sets {flag}: biases other than q/k/v do not convert")
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hidden = int(config["hidden_size"])
    if heads % kv_heads:
        raise ConvertError(f"config.json num_attention_heads {heads} is not a multiple of "
                           f"num_key_value_heads {kv_heads}")
    theta, scaling = _rope(config)
    layers = int(config["num_hidden_layers"])
    if family == "deepseek_v3":
        if scaling is not None:
            raise ConvertError("config.json asks for Llama 3.1's RoPE scaling: a DeepSeek-V3 model converts with "
                               "YaRN or unscaled RoPE")
        return _deepseek(config, hidden, heads, theta, layers)
    return Arch(num_layers=layers, hidden_size=hidden,
                ffn_hidden_size=int(config["intermediate_size"]), num_heads=heads, num_kv_heads=kv_heads,
                head_dim=int(config.get("head_dim") or hidden // heads), vocab_size=int(config["vocab_size"]),
                norm_epsilon=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling_factor=scaling,
                tied_embeddings=bool(config.get("tie_word_embeddings", False)), qkv_bias=add_qkv_bias,
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                family=family, qk_layernorm=family in ("qwen3", "qwen3_moe"), yarn=_yarn(config),
                **_moe(config, family, layers))


def _moe(config: dict, family: str, layers: int) -> dict:
    """The MoE fields of Arch for the MoE families (none for a dense model)."""
    if family == "qwen3_moe":
        experts = int(config.get("num_experts") or config["num_local_experts"])
        step = int(config.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in config.get("mlp_only_layers") or []}
        # transformers' Qwen3MoeDecoderLayer: MoE where not in mlp_only_layers and (i + 1) % step == 0
        pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
        ffn, norm = int(config["moe_intermediate_size"]), bool(config.get("norm_topk_prob", False))
    elif family == "mixtral":
        experts, pattern = int(config["num_local_experts"]), (1,) * layers
        ffn, norm = int(config["intermediate_size"]), True     # Mixtral always renormalizes the top-k
    else:
        return {}
    topk = int(config["num_experts_per_tok"])
    if not 0 < topk <= experts:
        raise ConvertError(f"config.json num_experts_per_tok {topk} is not between 1 and the {experts} experts")
    if not any(pattern):
        raise ConvertError("config.json places no MoE layer (decoder_sparse_step / mlp_only_layers): "
                           "a dense model does not convert as qwen3-moe")
    coeff = config.get("router_aux_loss_coef")
    return dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=ffn, moe_layers=pattern,
                norm_topk_prob=norm, moe_aux_loss_coeff=float(coeff) if coeff else None)


def _deepseek(config: dict, hidden: int, heads: int, theta: float, layers: int) -> Arch:
    if config.get("rope_interleave") is False:
        raise ConvertError("config.json has rope_interleave false: Megatron-Core's multi-latent attention takes "
                           "DeepSeek's interleaved RoPE layout only")
    q_rank = config.get("q_lora_rank")
    mla = (int(q_rank) if q_rank else None, int(config["kv_lora_rank"]), int(config["qk_nope_head_dim"]),
           int(config["qk_rope_head_dim"]), int(config["v_head_dim"]))
    experts = int(config.get("n_routed_experts") or 0)
    first_dense = int(config.get("first_k_dense_replace") or 0)
    topk = int(config["num_experts_per_tok"]) if experts else 0
    moe = {}
    if experts:
        if not 0 < topk <= experts:
            raise ConvertError(f"config.json num_experts_per_tok {topk} is not between 1 and the {experts} experts")
        if topk > 1 and not config.get("norm_topk_prob", True):
            raise ConvertError("config.json has norm_topk_prob false: Megatron-Core's sigmoid router always "
                               "renormalizes the top-k weights")
        groups, group_topk = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
        if groups > 1 and (experts % groups or topk % group_topk or topk // group_topk != 2):
            # transformers scores a group by its top 2 experts, Megatron-Core by its top (top-k / topk_group)
            raise ConvertError(f"config.json's group-limited routing (n_group {groups}, topk_group {group_topk}, "
                               f"num_experts_per_tok {topk}): Megatron-Core scores each group by its top "
                               "num_experts_per_tok / topk_group experts, transformers by its top 2: only configs "
                               "where those agree convert (DeepSeek-V3's 8 / 4)")
        if first_dense >= layers:
            raise ConvertError(f"config.json first_k_dense_replace {first_dense} leaves no MoE layer of {layers}")
        scaling = config.get("routed_scaling_factor")
        shared = int(config.get("n_shared_experts") or 0) * int(config["moe_intermediate_size"])
        moe = dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=int(config["moe_intermediate_size"]),
                   moe_layers=tuple(int(i >= first_dense) for i in range(layers)), norm_topk_prob=True,
                   router_sigmoid=True, moe_groups=(groups, group_topk) if groups > 1 else None,
                   routed_scaling_factor=float(scaling) if scaling not in (None, 1, 1.0) else None,
                   shared_expert_ffn=shared)
    return Arch(num_layers=layers, hidden_size=hidden, ffn_hidden_size=int(config["intermediate_size"]),
                num_heads=heads, num_kv_heads=heads, head_dim=mla[2] + mla[3], vocab_size=int(config["vocab_size"]),
                norm_epsilon=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling_factor=None,
                tied_embeddings=bool(config.get("tie_word_embeddings", False)), qkv_bias=False,
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)), family="deepseek_v3",
                qk_layernorm=True, mla=mla, yarn=_yarn(config), **moe)


def pipeline_split_flags(layer_list: list[int] | None) -> list[str]:
    """The trainer's flags for an uneven pipeline split (none for an even one)."""
    if not layer_list or len(set(layer_list)) == 1:
        return []
    return ["--decoder-first-pipeline-num-layers", str(layer_list[0]),
            "--decoder-last-pipeline-num-layers", str(layer_list[-1])]


def check_parallel(arch: Arch, tp: int, pp: int, layer_list: list[int] | None, ep: int = 1) -> None:
    """What the target tensor/pipeline/expert sizes need of the model (the trainer checks the same)."""
    sizes = [("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads),
             ("intermediate_size", arch.ffn_hidden_size)]
    if arch.num_experts:       # each expert is split over the tensor-parallel ranks too
        sizes.append(("moe_intermediate_size" if arch.family != "mixtral" else "intermediate_size",
                      arch.moe_ffn_hidden_size))
    if arch.mla is not None:
        sizes = [s for s in sizes if s[0] != "num_key_value_heads"]
    for name, value in sizes:
        if value % tp:
            raise ConvertError(f"config.json {name} {value} is not divisible by "
                               f"--target-tensor-parallel-size {tp}")
    if ep > 1 and not arch.num_experts:
        raise ConvertError(f"--target-expert-parallel-size {ep}: the model has no experts (drop it)")
    if arch.num_experts % ep:
        raise ConvertError(f"config.json has {arch.num_experts} experts, not divisible by "
                           f"--target-expert-parallel-size {ep}")
    if layer_list is not None:
        if len(layer_list) != pp:
            raise ConvertError(f"--num-layer-list has {len(layer_list)} entries, "
                               f"--target-pipeline-parallel-size is {pp}")
        text = ",".join(map(str, layer_list))
        if sum(layer_list) != arch.num_layers or min(layer_list) < 1:
            raise ConvertError(f"--num-layer-list {text} does not split the model's {arch.num_layers} "
                               "layers into positive stages")
        if len(set(layer_list[1:-1])) > 1:
            raise ConvertError(f"--num-layer-list {text}: the trainer (as Megatron-Core) can give only the first "
                               "and the last pipeline stage their own layer counts; the others must be equal")
    elif arch.num_layers % pp:
        raise ConvertError(f"num_hidden_layers {arch.num_layers} is not divisible by "
                           f"--target-pipeline-parallel-size {pp} (give --num-layer-list)")
