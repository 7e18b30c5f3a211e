"""The built-in trainers' checkpoints -> Hugging Face safetensors + config.json: the torch trainer's
torch_dist (any TP/PP it was saved at) or legacy per-rank files (--ckpt-format torch), or the MindSpore
trainer's framework-neutral safetensors.
The Hugging Face config comes from --hf-config, else from --save-dir when that holds a Hugging Face
model, else from the hf_config/ folder that hf->mg left in the checkpoint.

A --save-dir that holds a Hugging Face model (the original one, as MindSpeed-LLM's guides have it)
receives the converted model in its mg2hg/ subfolder, as MindSpeed-LLM writes it; its own files stay
as they are, and an mg2hg/ that is already there and not empty is refused."""
from __future__ import annotations

import dataclasses
import os
import time

import torch

from mindspeed.convert import layout, lora_merge, sidecar
from mindspeed.convert.arch import QKV_BIAS, Arch, arch_from_config, read_config
from mindspeed.errors import ConvertError
from mindspeed.convert.hf_io import HFWriter, copy_side_files
from mindspeed.checkpoint.megatron_read import open_checkpoint
from mindspeed.convert.staging import check_save_dir, staged

HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_checkpoint(reader, arch: Arch, model_type_hf: str | None = None) -> None:
    """The checkpoint's tensors are the ones the Hugging Face config describes."""
    has_bias = reader.has_layer("self_attention.linear_qkv.bias")
    if model_type_hf not in QKV_BIAS:     # --add-qkv-bias decides (the other types fix the biases)
        if has_bias and not arch.qkv_bias:
            raise ConvertError(f"checkpoint {reader.dir} has q/k/v biases: add --add-qkv-bias")
        if arch.qkv_bias and not has_bias:
            raise ConvertError(f"--add-qkv-bias given but checkpoint {reader.dir} has no q/k/v biases")
    if not arch.tied_embeddings and not reader.has("output_layer.weight"):
        raise ConvertError(f"config.json has untied embeddings but checkpoint {reader.dir} has no output_layer")
    if arch.tied_embeddings and reader.has("output_layer.weight"):
        raise ConvertError(f"checkpoint {reader.dir} has its own output_layer (trained with "
                           "--untie-embeddings-and-output-weights) but config.json ties the embeddings "
                           "(tie_word_embeddings true), which would drop it: give --hf-config a copy of the "
                           "config with tie_word_embeddings false")
    h = arch.hidden_size
    if reader.num_layers() != arch.num_layers:
        raise ConvertError(f"checkpoint {reader.dir} has {reader.num_layers()} layers, the Hugging Face config "
                           f"{arch.num_layers} (wrong --hf-config?)")
    if reader.mtp_layers() and arch.family != "deepseek_v3":
        raise ConvertError(f"checkpoint {reader.dir} has multi-token-prediction layers: only --model-type-hf "
                           "deepseek3 converts them")
    for i in range(arch.num_layers + arch.mtp_layers):
        block = _block(arch, i)
        want = layout.mg_layer_shapes(arch, i)
        have = reader.layer_suffixes(block)
        missing = [suffix for suffix in want if suffix not in have]
        where = layout.mg_prefix(arch, i)
        if missing:
            raise ConvertError(f"checkpoint {reader.dir} has no {where}{missing[0]}, which the Hugging "
                               f"Face config implies ({_kind(arch, i)}: wrong --model-type-hf or --hf-config?)")
        extra = sorted(suffix for suffix in have - set(want) if ".lora." not in suffix)
        if extra:
            raise ConvertError(f"checkpoint {reader.dir} has {where}{extra[0]}, which the Hugging Face "
                               f"config does not describe ({_kind(arch, i)}: wrong --model-type-hf or --hf-config?)")
        for suffix, shape in want.items():
            got = reader.layer_shape(suffix, block)
            if got != shape:
                raise ConvertError(f"checkpoint {where}{suffix} has shape {got}, the Hugging Face config implies "
                                   f"{shape} (wrong --hf-config?)")
    if reader.shape("decoder.final_layernorm.weight") != (h,):
        raise ConvertError(f"checkpoint hidden size {reader.shape('decoder.final_layernorm.weight')} != {h}")
    width = reader.shape("embedding.word_embeddings.weight")[1]
    if width != h:
        raise ConvertError(f"checkpoint embedding width {width} is not the Hugging Face config's hidden size {h}")


def _block(arch: Arch, i: int):
    """The reader's name of block i: decoder layer i, or the prefix of MTP layer i - num_layers."""
    return i if i < arch.num_layers else layout.mg_prefix(arch, i)


def _kind(arch: Arch, i: int) -> str:
    """What the config makes of layer i, for a refusal."""
    what = [f"{arch.num_experts} experts" if arch.is_moe_layer(i) else "a dense MLP"]
    if arch.mla is not None:
        what.append("multi-latent attention")
    else:
        what.append("q/k norms" if arch.qk_layernorm else "no q/k norms")
    return "layer " + str(i) + ": " + ", ".join(what)


def with_mtp_layers(reader, arch: Arch) -> Arch:
    """A DeepSeek-V3 model with the checkpoint's multi-token-prediction layers."""
    return dataclasses.replace(arch, mtp_layers=reader.mtp_layers()) if arch.family == "deepseek_v3" else arch


MG2HG = "mg2hg"


def hf_model_save_dir(save_dir: str) -> bool:
    """--save-dir holds a Hugging Face model: the weights go to its mg2hg/ (MindSpeed-LLM's rule)."""
    return os.path.isfile(os.path.join(save_dir, "config.json"))


def _config_dir(opts) -> str:
    if opts.hf_config:
        return opts.hf_config if os.path.isdir(opts.hf_config) else os.path.dirname(opts.hf_config)
    if hf_model_save_dir(opts.save_dir):
        return opts.save_dir
    side = os.path.join(opts.load_dir, sidecar.HF_CONFIG_DIR)
    if not os.path.isfile(os.path.join(side, "config.json")):
        raise ConvertError(f"{opts.load_dir} has no {sidecar.HF_CONFIG_DIR}/config.json (it was not written "
                           "by this converter): give the Hugging Face model's directory with --hf-config, or as "
                           "--save-dir (the weights then go to its mg2hg/)")
    return side


def check_grouped(reader, opts, log) -> None:
    """--moe-grouped-gemm says how a legacy checkpoint holds its experts; torch_dist holds them alike either
    way (as the MindSpore trainer's files do), so there it changes nothing."""
    if opts.ckpt_format is not None:
        log(f"> --ckpt-format {opts.ckpt_format} has no effect on mg->hf: the checkpoint's own format is read")
    grouped = getattr(reader, "grouped", None)     # a legacy checkpoint's
    if grouped is None:
        if opts.moe_grouped_gemm:
            log(f"> --moe-grouped-gemm has no effect here: {reader.dir} stores each expert under its global "
                "index whichever MLP the trainer built")
        return
    if grouped and not opts.moe_grouped_gemm:
        raise ConvertError(f"checkpoint {reader.dir} holds GroupedMLP's fused expert weights (mlp.experts.weight1/"
                           "weight2: trained with --moe-grouped-gemm): add --moe-grouped-gemm")
    if opts.moe_grouped_gemm and not grouped:
        raise ConvertError(f"--moe-grouped-gemm given but checkpoint {reader.dir} holds no GroupedMLP weights "
                           "(its experts are separate MLPs, or it has none): drop --moe-grouped-gemm")


def convert(opts, log=print) -> dict:
    start = time.perf_counter()
    if not os.path.isdir(opts.load_dir):
        raise ConvertError(f"--load-dir {opts.load_dir} does not exist or is not a directory")
    config_dir = _config_dir(opts)
    config = read_config(config_dir, "--hf-config" if opts.hf_config else "--load-dir")
    arch = arch_from_config(config, opts.model_type_hf, opts.add_qkv_bias)
    out_dir = opts.save_dir
    if hf_model_save_dir(opts.save_dir):
        out_dir = os.path.join(opts.save_dir, MG2HG)
        check_save_dir(out_dir, out_dir, f"--save-dir {opts.save_dir} holds a Hugging Face model, so the "
                                         f"weights go to its {MG2HG}/; nothing is overwritten: move or remove it")
    check_save_dir(out_dir)
    reader = open_checkpoint(opts.load_dir)
    check_grouped(reader, opts, log)
    arch = with_mtp_layers(reader, arch)
    check_checkpoint(reader, arch, opts.model_type_hf)
    adapters = lora_merge.adapters_for(opts)
    dtype = HF_DTYPES.get(config.get("dtype") or config.get("torch_dtype"))
    shapes = layout.hf_shapes(arch)

    with staged(out_dir) as tmp:
        writer = HFWriter(tmp)

        def add(name: str, tensor: torch.Tensor) -> None:
            if tuple(tensor.shape) != shapes[name]:   # a layout bug, never the user's input
                raise AssertionError(f"{name}: {tuple(tensor.shape)} != {shapes[name]}")
            # DeepSeek-V3's routing bias stays fp32, as its checkpoints (and Megatron-Core) keep it
            keep = name.endswith("e_score_correction_bias")
            writer.add(name, tensor.to(dtype) if dtype is not None and not keep else tensor)

        # the config's vocab_size rows: rows the checkpoint lacks (cut to a smaller tokenizer by
        # hf->mg --tokenizer-model) come back as zeros
        v = arch.vocab_size

        def vocab_rows(weight: torch.Tensor) -> torch.Tensor:
            return layout.fit_vocab(weight, min(v, weight.shape[0]), v).clone()

        add("model.embed_tokens.weight", vocab_rows(reader.get("embedding.word_embeddings.weight")))
        for i in range(arch.num_layers + arch.mtp_layers):
            mg = {suffix: reader.get_layer(suffix, _block(arch, i)) for suffix in layout.mg_layer_shapes(arch, i)}
            if adapters is not None and i < arch.num_layers:
                adapters.fold(mg, i)
            for name, tensor in layout.mg_to_hf_layer(arch, i, mg).items():
                add(name, tensor)
            if i >= arch.num_layers:     # the main model's embedding and output layer, as the MTP layer's
                head = "embedding.word_embeddings.weight" if arch.tied_embeddings else "output_layer.weight"
                add(f"model.layers.{i}.embed_tokens.weight",
                    vocab_rows(reader.get("embedding.word_embeddings.weight")))
                add(f"model.layers.{i}.shared_head.head.weight", vocab_rows(reader.get(head)))
        add("model.norm.weight", reader.get("decoder.final_layernorm.weight"))
        if not arch.tied_embeddings:
            add("lm_head.weight", vocab_rows(reader.get("output_layer.weight")))
        writer.finish()
        copy_side_files(config_dir, tmp)
    seconds = time.perf_counter() - start
    merged = f" with the LoRA adapters of {opts.lora_load} merged" if adapters is not None else ""
    log(f"converted {opts.load_dir}{merged} -> {out_dir} ({arch.num_layers} layers, "
        f"{writer.total / 2**20:.1f} MiB of weights) in {seconds:.1f}s")
    return {"seconds": seconds, "out_dir": out_dir}
