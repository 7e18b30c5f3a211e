"""Hugging Face (safetensors + config.json) -> the built-in trainer's Megatron-Core checkpoint."""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import time

import torch

from mindspeed.convert import layout, legacy_write, megatron_write, sidecar
from mindspeed.convert.arch import QKV_BIAS, Arch, arch_from_config, check_parallel, pipeline_split_flags, read_config
from mindspeed.errors import ConvertError
from mindspeed.flags.trainer_flags import padded_vocab_size
from mindspeed.convert.hf_io import HFReader, copy_side_files
from mindspeed.convert.staging import check_save_dir, staged
from mindspeed.data.tokenizer_vocab import tokenizer_vocab_size

# buffers some older checkpoints carry; recomputed by every model, not weights
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def check_tensors(reader: HFReader, arch: Arch, model_type_hf: str | None = None) -> None:
    """Every tensor the config implies is there with its shape, and nothing unexplained is."""
    names = reader.names()
    has_bias = any(n.endswith("self_attn.q_proj.bias") for n in names)
    if model_type_hf not in QKV_BIAS:     # --add-qkv-bias decides (the other types fix the biases)
        if has_bias and not arch.qkv_bias:
            raise ConvertError(f"{reader.dir} has q/k/v biases (Qwen2-style): add --add-qkv-bias")
        if arch.qkv_bias and not has_bias:
            raise ConvertError(f"--add-qkv-bias given but {reader.dir} has no q/k/v biases")
    check_tied_embeddings(reader, arch)
    expected = layout.hf_shapes(arch)
    missing = sorted(set(expected) - names)
    if missing:
        raise ConvertError(f"{reader.dir} lacks {len(missing)} tensor(s) the config implies, e.g. {missing[0]}")
    extra = sorted(n for n in names - set(expected) if not IGNORED.match(n)
                   and not (arch.tied_embeddings and n == "lm_head.weight"))
    if extra:
        raise ConvertError(f"{reader.dir} has {len(extra)} tensor(s) a {arch.num_layers}-layer model of its "
                           f"config.json does not, e.g. {extra[0]} (config.json and weights disagree?)")
    for name, shape in expected.items():
        got = reader.shape(name)
        if got != shape:
            raise ConvertError(f"{name} has shape {got}, config.json implies {shape}")
    check_mtp_shared(reader, arch)


def with_mtp_layers(reader: HFReader, arch: Arch) -> Arch:
    """A DeepSeek-V3 model with its multi-token-prediction layers where the weights have them
    (model.layers.<num_hidden_layers + j>; transformers' own save has none)."""
    if arch.family != "deepseek_v3":
        return arch
    extra = sorted({int(n.split(".")[2]) for n in reader.names()
                    if n.startswith("model.layers.") and n.split(".")[2].isdigit()
                    and int(n.split(".")[2]) >= arch.num_layers})
    if extra != list(range(arch.num_layers, arch.num_layers + len(extra))):
        raise ConvertError(f"{reader.dir} has layers {extra} beyond the config's {arch.num_layers}: multi-token-"
                           "prediction layers follow the decoder layers without a gap")
    return dataclasses.replace(arch, mtp_layers=len(extra))


def check_mtp_shared(reader: HFReader, arch: Arch, rows_at_once: int = 4096) -> None:
    """An MTP layer's embedding and output head are the main model's (Megatron-Core shares them)."""
    for i in range(arch.num_layers, arch.num_layers + arch.mtp_layers):
        for name, main in layout.MTP_SHARED.items():
            main = "model.embed_tokens.weight" if arch.tied_embeddings and main == "lm_head.weight" else main
            if not _same_rows(reader, f"model.layers.{i}.{name}", main, rows_at_once):
                raise ConvertError(f"model.layers.{i}.{name} differs from {main}: Megatron-Core's multi-token "
                                   "prediction shares the main model's, so this model does not convert")


def _same_rows(reader: HFReader, a: str, b: str, rows_at_once: int) -> bool:
    """Tensors a and b are equal, compared a few thousand rows at a time."""
    if reader.shape(a) != reader.shape(b):
        return False
    rows = reader.shape(a)[0]
    return all(torch.equal(reader.get_rows(a, i, i + rows_at_once), reader.get_rows(b, i, i + rows_at_once))
               for i in range(0, rows, rows_at_once))


def check_tied_embeddings(reader: HFReader, arch: Arch, rows_at_once: int = 4096) -> None:
    """config.json's tie_word_embeddings agrees with the weights: an untied model has its own
    lm_head.weight; a tied one has none, or (as some exports write it) a copy of the embedding.
    Compared a few thousand rows at a time: two whole embeddings need not fit in memory."""
    names = reader.names()
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if not arch.tied_embeddings and head not in names:
        raise ConvertError(f"config.json has tie_word_embeddings false (untied) but {reader.dir} has no {head}: "
                           "the weights are tied; set tie_word_embeddings true if the model shares them")
    if not arch.tied_embeddings or head not in names or embed not in names:
        return
    if _same_rows(reader, head, embed, rows_at_once):
        return
    raise ConvertError(f"config.json ties the embeddings (tie_word_embeddings true) but {reader.dir} has an "
                       f"{head} that differs from {embed}: set tie_word_embeddings false if the model has "
                       "its own output layer")


def _padded_rows(opts, vocab: int, tp: int) -> int:
    """The embedding/output rows to write: --padded-vocab-size (as the trainer takes it: at least the
    vocabulary, divisible by TP), else the vocabulary padded as the trainer pads it at TP `tp`."""
    given = opts.padded_vocab_size
    if given is None:
        return padded_vocab_size(vocab, opts.make_vocab_size_divisible_by, tp)
    if given < vocab:
        source = "--tokenizer-model's" if opts.tokenizer_model else "config.json's"
        raise ConvertError(f"--padded-vocab-size {given} is smaller than the vocabulary ({vocab}, {source}): "
                           f"give at least {vocab}")
    if given % tp:
        raise ConvertError(f"--padded-vocab-size {given} is not divisible by --target-tensor-parallel-size {tp}")
    return given


def check_format_flags(opts, arch: Arch, legacy: bool) -> None:
    """--ckpt-format torch and --moe-grouped-gemm ask for what the model and the other flags allow."""
    if legacy and opts.neutral_copy:
        raise ConvertError("--neutral-copy goes beside torch_dist files, which the MindSpore trainer reads: drop "
                           "--ckpt-format torch (or --neutral-copy)")
    if opts.moe_grouped_gemm and not arch.num_experts:
        raise ConvertError(f"--moe-grouped-gemm: the model has no experts (--model-type-hf {opts.model_type_hf}): "
                           "drop it")
    if opts.moe_grouped_gemm and opts.params_dtype != "bf16":
        raise ConvertError("--moe-grouped-gemm: the trainer's GroupedMLP (Megatron-Core's) runs in bf16 only: add "
                           "--params-dtype bf16")


def convert(opts, log=print) -> dict:
    start = time.perf_counter()
    if not os.path.isdir(opts.load_dir):
        raise ConvertError(f"--load-dir {opts.load_dir} does not exist or is not a directory")
    # the trainer pads its tokenizer's vocabulary: with --tokenizer-model the rows follow it
    vocab_from_tokenizer = tokenizer_vocab_size(opts.tokenizer_model) if opts.tokenizer_model else None
    arch = arch_from_config(read_config(opts.load_dir), opts.model_type_hf, opts.add_qkv_bias)
    tp, pp = opts.target_tensor_parallel_size, opts.target_pipeline_parallel_size
    ep = opts.target_expert_parallel_size
    check_parallel(arch, tp, pp, opts.num_layer_list, ep)
    if opts.neutral_copy and arch.num_experts:
        raise ConvertError(f"--neutral-copy: the MindSpore trainer does not build MoE layers "
                           f"(--model-type-hf {opts.model_type_hf}); convert without it for the torch trainer")
    legacy = opts.ckpt_format == "torch"
    check_format_flags(opts, arch, legacy)
    vocab = vocab_from_tokenizer or arch.vocab_size
    padded = _padded_rows(opts, vocab, tp)
    check_save_dir(opts.save_dir)
    reader = HFReader(opts.load_dir)
    try:
        arch = with_mtp_layers(reader, arch)
        check_tensors(reader, arch, opts.model_type_hf)
        with staged(opts.save_dir) as tmp:
            if legacy:
                legacy_write.write_legacy(tmp, arch, reader, vocab, padded, opts.params_dtype, tp, pp, ep,
                                          opts.num_layer_list, opts.moe_grouped_gemm)
            else:
                megatron_write.write_megatron(tmp, arch, reader, vocab, padded, opts.params_dtype,
                                              neutral_copy=opts.neutral_copy)
            side = os.path.join(tmp, sidecar.HF_CONFIG_DIR)
            os.makedirs(side)
            extra = (opts.tokenizer_model,) if opts.tokenizer_model and os.path.isfile(opts.tokenizer_model) else ()
            copy_side_files(opts.load_dir, side, extra)
            flags = arch.trainer_flags() + ["--tensor-model-parallel-size", str(tp),
                                            "--pipeline-model-parallel-size", str(pp),
                                            "--make-vocab-size-divisible-by", str(opts.make_vocab_size_divisible_by)]
            flags += pipeline_split_flags(opts.num_layer_list)
            if ep > 1:
                flags += ["--expert-model-parallel-size", str(ep)]
            if opts.padded_vocab_size is not None:   # the trainer must build these rows
                flags += ["--padded-vocab-size", str(padded)]
            flags += {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}[opts.params_dtype]
            flags += (["--ckpt-format", "torch"] if legacy else []) + \
                (["--moe-grouped-gemm"] if opts.moe_grouped_gemm else [])
            sidecar.write_info(tmp, {"model_type_hf": opts.model_type_hf, "params_dtype": opts.params_dtype,
                                     "target_tensor_parallel_size": tp, "target_pipeline_parallel_size": pp,
                                     "target_expert_parallel_size": ep,
                                     "num_layer_list": opts.num_layer_list, "vocab_size": vocab,
                                     "hf_vocab_size": arch.vocab_size,
                                     "neutral_copy": opts.neutral_copy,
                                     "ckpt_format": opts.ckpt_format or "torch_dist",
                                     "moe_grouped_gemm": opts.moe_grouped_gemm,
                                     "padded_vocab_size": padded, "trainer_flags": flags})
    finally:
        reader.close()
    seconds = time.perf_counter() - start
    log(f"converted {opts.load_dir} -> {opts.save_dir} ({arch.num_layers} layers, vocab {vocab} "
        f"padded to {padded}, {opts.params_dtype}) in {seconds:.1f}s")
    log("load it in the trainer with --load " + shlex.quote(opts.save_dir) + " --finetune " + shlex.join(flags))
    return {"seconds": seconds, "trainer_flags": flags}
