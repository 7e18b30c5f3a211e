"""The built-in trainer's Megatron-Core checkpoint (any TP/PP it was saved at) -> Hugging Face
safetensors + config.json. The Hugging Face config comes from the hf_config/ folder that hf->mg
left in the checkpoint, or from --hf-config (a checkpoint the trainer saved elsewhere)."""
from __future__ import annotations

import os
import time

import torch

from mindspeed.convert import layout, sidecar
from mindspeed.convert.arch import Arch, arch_from_config, read_config
from mindspeed.convert.errors import ConvertError
from mindspeed.convert.hf_io import HFWriter, copy_side_files
from mindspeed.convert.megatron_read import MegatronReader
from mindspeed.convert.staging import check_save_dir, staged

HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STACKED = "decoder.layers."   # checkpoint keys of decoder layers: one tensor stacked over layers
CKPT_LAYER_KEYS = {   # Megatron model-local suffix -> the checkpoint key (the local spec's norms
    # are stored under Transformer Engine's fused names, as Megatron-Core does for compatibility)
    "input_layernorm.weight": STACKED + "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": STACKED + "mlp.linear_fc1.layer_norm_weight",
    "self_attention.linear_qkv.weight": STACKED + "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias": STACKED + "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight": STACKED + "self_attention.linear_proj.weight",
    "mlp.linear_fc1.weight": STACKED + "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight": STACKED + "mlp.linear_fc2.weight",
}


def check_checkpoint(reader: MegatronReader, arch: Arch) -> None:
    """The checkpoint's tensors are the ones the Hugging Face config describes."""
    has_bias = reader.has(CKPT_LAYER_KEYS["self_attention.linear_qkv.bias"])
    if has_bias and not arch.qkv_bias:
        raise ConvertError(f"checkpoint {reader.dir} has q/k/v biases: add --add-qkv-bias")
    if arch.qkv_bias and not has_bias:
        raise ConvertError(f"--add-qkv-bias given but checkpoint {reader.dir} has no q/k/v biases")
    if not arch.tied_embeddings and not reader.has("output_layer.weight"):
        raise ConvertError(f"config.json has untied embeddings but checkpoint {reader.dir} has no output_layer")
    h, d = arch.hidden_size, arch.head_dim
    want = {CKPT_LAYER_KEYS["self_attention.linear_qkv.weight"]:
            (arch.num_layers, (arch.num_heads + 2 * arch.num_kv_heads) * d, h),
            CKPT_LAYER_KEYS["mlp.linear_fc1.weight"]: (arch.num_layers, 2 * arch.ffn_hidden_size, h),
            "decoder.final_layernorm.weight": (h,)}
    for key, shape in want.items():
        if reader.shape(key) != shape:
            raise ConvertError(f"checkpoint {key} has shape {reader.shape(key)}, the Hugging Face config "
                               f"implies {shape} (wrong --hf-config?)")
    rows, width = reader.shape("embedding.word_embeddings.weight")
    if rows < arch.vocab_size or width != h:
        raise ConvertError(f"checkpoint embedding {rows}x{width} cannot hold vocab_size {arch.vocab_size} x "
                           f"hidden {h} of the Hugging Face config")


def _config_dir(opts) -> str:
    if opts.hf_config:
        return opts.hf_config if os.path.isdir(opts.hf_config) else os.path.dirname(opts.hf_config)
    side = os.path.join(opts.load_dir, sidecar.HF_CONFIG_DIR)
    if not os.path.isfile(os.path.join(side, "config.json")):
        raise ConvertError(f"{opts.load_dir} has no {sidecar.HF_CONFIG_DIR}/config.json (it was not written "
                           "by this converter): give the Hugging Face model's directory with --hf-config")
    return side


def convert(opts, log=print) -> dict:
    start = time.perf_counter()
    if not os.path.isdir(opts.load_dir):
        raise ConvertError(f"--load-dir {opts.load_dir} does not exist or is not a directory")
    config_dir = _config_dir(opts)
    config = read_config(config_dir)
    arch = arch_from_config(config, opts.model_type_hf, opts.add_qkv_bias)
    check_save_dir(opts.save_dir)
    reader = MegatronReader(opts.load_dir)
    check_checkpoint(reader, arch)
    dtype = HF_DTYPES.get(config.get("dtype") or config.get("torch_dtype"))
    shapes = layout.hf_shapes(arch)

    with staged(opts.save_dir) as tmp:
        writer = HFWriter(tmp)

        def add(name: str, tensor: torch.Tensor) -> None:
            if tuple(tensor.shape) != shapes[name]:   # a layout bug, never the user's input
                raise AssertionError(f"{name}: {tuple(tensor.shape)} != {shapes[name]}")
            writer.add(name, tensor.to(dtype) if dtype is not None else tensor)

        v = arch.vocab_size
        add("model.embed_tokens.weight", reader.get("embedding.word_embeddings.weight")[:v].clone())
        for i in range(arch.num_layers):
            mg = {suffix: reader.get(key, layer=i) for suffix, key in CKPT_LAYER_KEYS.items()
                  if reader.has(key)}
            for name, tensor in layout.mg_to_hf_layer(arch, i, mg).items():
                add(name, tensor)
        add("model.norm.weight", reader.get("decoder.final_layernorm.weight"))
        if not arch.tied_embeddings:
            add("lm_head.weight", reader.get("output_layer.weight")[:v].clone())
        writer.finish()
        copy_side_files(config_dir, tmp)
    seconds = time.perf_counter() - start
    log(f"converted {opts.load_dir} -> {opts.save_dir} ({arch.num_layers} layers, "
        f"{writer.total / 2**20:.1f} MiB of weights) in {seconds:.1f}s")
    return {"seconds": seconds}
