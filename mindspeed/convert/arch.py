"""The architecture of a Llama-family model, read from a Hugging Face config.json and checked
against the converter's flags; also the trainer flags that rebuild the same model.

Supported: Llama 2/3/3.1 (model_type "llama") and Qwen2/2.5 ("qwen2"): RMSNorm, SwiGLU, RoPE (plain,
or Llama 3.1's scaling), no linear biases except optional q/k/v biases, tied or untied embeddings, GQA.
Qwen2 is the Llama layout plus q/k/v biases, so --model-type-hf llama2/llama3 convert it too (with
--add-qkv-bias), as MindSpeed-LLM's guides for Qwen2.5 ask.
"""
from __future__ import annotations

import dataclasses
import json
import os

from mindspeed.errors import ConvertError

# --model-type-hf -> the config.json model_types it converts (all of them the Llama layout)
HF_MODEL_TYPES = {"llama2": ("llama", "qwen2"), "llama3": ("llama", "qwen2"), "qwen2": ("qwen2",)}


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

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def trainer_flags(self) -> list[str]:
        """The built-in trainer's flags for this model (data/tokenizer flags are the user's)."""
        flags = ["--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
                 "--ffn-hidden-size", str(self.ffn_hidden_size),
                 "--num-attention-heads", str(self.num_heads),
                 "--group-query-attention", "--num-query-groups", str(self.num_kv_heads),
                 "--kv-channels", str(self.head_dim),
                 "--position-embedding-type", "rope", "--rotary-base", str(int(self.rope_theta)),
                 "--normalization", "RMSNorm", "--norm-epsilon", repr(self.norm_epsilon),
                 "--swiglu", "--disable-bias-linear"]
        if self.rope_scaling_factor is not None:
            flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(self.rope_scaling_factor)]
        if self.qkv_bias:
            flags.append("--add-qkv-bias")
        if not self.tied_embeddings:
            flags.append("--untie-embeddings-and-output-weights")
        return flags


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


def _rope(config: dict) -> tuple[float, float | None]:
    """(rope_theta, Llama 3.1 scaling factor or None). transformers 5 writes rope_parameters;
    older configs (and the Hub's) have rope_theta and rope_scaling."""
    params = dict(config.get("rope_scaling") or {}, **(config.get("rope_parameters") or {}))
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise ConvertError(f"config.json rope_theta {theta} is not an integer (the trainer's --rotary-base is)")
    if kind == "default":
        return float(theta), None
    fixed = {k: params.get(k) for k in LLAMA3_SCALING_FIXED}
    if kind != "llama3" or any(fixed[k] is None or float(fixed[k]) != v for k, v in LLAMA3_SCALING_FIXED.items()):
        raise ConvertError(f"config.json asks for RoPE scaling {kind!r} {fixed}: only unscaled RoPE and Llama 3.1's "
                           f"'llama3' scaling with {LLAMA3_SCALING_FIXED} convert (the trainer has only those)")
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
        layout = "is not a Llama-layout model" if got not in HF_MODEL_TYPES["llama2"] else "does not match"
        raise ConvertError(f"config.json model_type {got!r}{named} {layout}: --model-type-hf {model_type_hf} "
                           f"converts model_type {' or '.join(map(repr, want))}")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConvertError(f"config.json hidden_act {act!r}: only SwiGLU (silu) MLPs convert")
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
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
    return Arch(num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
                ffn_hidden_size=int(config["intermediate_size"]), num_heads=heads, num_kv_heads=kv_heads,
                head_dim=int(config.get("head_dim") or hidden // heads), vocab_size=int(config["vocab_size"]),
                norm_epsilon=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling_factor=scaling,
                tied_embeddings=bool(config.get("tie_word_embeddings", False)), qkv_bias=add_qkv_bias,
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)))


def pipeline_split_flags(layer_list: list[int] | None) -> list[str]:
    """The trainer's flags for an uneven pipeline split (none for an even one)."""
    if not layer_list or len(set(layer_list)) == 1:
        return []
    return ["--decoder-first-pipeline-num-layers", str(layer_list[0]),
            "--decoder-last-pipeline-num-layers", str(layer_list[-1])]


def check_parallel(arch: Arch, tp: int, pp: int, layer_list: list[int] | None) -> None:
    """What the target tensor/pipeline sizes need of the model (the trainer checks the same)."""
    for name, value in (("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads),
                        ("intermediate_size", arch.ffn_hidden_size)):
        if value % tp:
            raise ConvertError(f"config.json {name} {value} is not divisible by "
                               f"--target-tensor-parallel-size {tp}")
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
