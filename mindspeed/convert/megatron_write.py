"""Writes a Megatron-Core checkpoint the way the built-in torch trainer does: its own GPTModel
(mindspeed.training.model) filled with the converted tensors, saved by its own
checkpointing.save_checkpoint (torch_dist through megatron.core.dist_checkpointing, iteration 0,
tracker file). torch_dist stores every tensor with its global shape, so the trainer loads it at
any TP/PP (dist_checkpointing reshards on load); the target TP only sets the vocabulary padding.

Everything runs in this one process, in a world of one gloo rank. The model is built without
random initialisation and filled one tensor at a time from the memory-mapped Hugging Face files,
so peak memory is one copy of the model in --params-dtype plus one Hugging Face layer.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from mindspeed.convert import layout
from mindspeed.convert.arch import Arch
from mindspeed.convert.errors import ConvertError
from mindspeed.convert.hf_io import HFReader

DTYPE_FLAGS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}


class _NoScheduler:
    """save_checkpoint stores the scheduler's state; a converted checkpoint has none (load it
    with --finetune, as any converted Megatron checkpoint)."""

    @staticmethod
    def state_dict() -> dict:
        return {}


@contextmanager
def world_of_one():
    """A one-rank gloo process group and Megatron's parallel state at TP=PP=1 (left as found)."""
    from megatron.core import parallel_state, tensor_parallel
    from mindspeed.net import free_port
    created = not torch.distributed.is_initialized()
    if created:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                             rank=0, world_size=1)
    elif torch.distributed.get_world_size() != 1:
        raise ConvertError("the converter runs in a single process (found a process group of "
                           f"{torch.distributed.get_world_size()})")
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            torch.distributed.destroy_process_group()


@contextmanager
def adapted(args):
    """MindSpeed's device shim (CPU stand-ins for Megatron's CUDA-only calls), as the trainer has it."""
    import mindspeed
    from mindspeed.adaptor_core import current
    if current() is not None:
        yield
        return
    mindspeed.adapt(args)
    try:
        yield
    finally:
        mindspeed.unadapt()


def trainer_args(arch: Arch, vocab: int, padded_vocab: int, params_dtype: str):
    from mindspeed.training.arguments import parse_args
    args = parse_args(arch.trainer_flags() + DTYPE_FLAGS[params_dtype] +
                      ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab - 1),
                       "--seq-length", "16", "--mock-data", "--backend", "torch", "--device", "cpu"], world_size=1)
    args.padded_vocab_size = padded_vocab
    return args


def _fill(model, arch: Arch, reader: HFReader, vocab: int, padded_vocab: int) -> None:
    params = dict(model.named_parameters())
    expected = {name for name in params}

    def put(name: str, tensor: torch.Tensor) -> None:
        target = params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ConvertError(f"{name}: converted shape {tuple(tensor.shape)} does not fit the model's "
                               f"{tuple(target.shape)}")
        target.data.copy_(tensor)
        expected.discard(name)

    with torch.no_grad():
        keep = min(vocab, arch.vocab_size)
        put("embedding.word_embeddings.weight",
            layout.fit_vocab(reader.get("model.embed_tokens.weight"), keep, padded_vocab))
        for i in range(arch.num_layers):
            hf = {name: reader.get(name) for name in layout.hf_layer_names(arch, i)}
            for suffix, tensor in layout.hf_to_mg_layer(arch, i, hf).items():
                put(f"decoder.layers.{i}.{suffix}", tensor)
        put("decoder.final_layernorm.weight", reader.get("model.norm.weight"))
        if not arch.tied_embeddings:
            put("output_layer.weight", layout.fit_vocab(reader.get("lm_head.weight"), keep, padded_vocab))
    if expected:
        raise ConvertError(f"the trainer's model has parameters the conversion did not fill: {sorted(expected)}")


def write_megatron(root: str, arch: Arch, reader: HFReader, vocab: int, padded_vocab: int, params_dtype: str,
                   neutral_copy: bool = False) -> None:
    """Save the model converted from `reader` as the trainer's iteration 0 under `root`, its
    embedding/output rows cut to the tokenizer's `vocab` and padded to `padded_vocab`; with
    neutral_copy, the same weights also as the MindSpore trainer's framework-neutral safetensors
    in the same iteration directory (each trainer reads only its own files there)."""
    from mindspeed.training import checkpointing
    from mindspeed.training.model import build_model_chunks, transformer_config
    args = trainer_args(arch, vocab, padded_vocab, params_dtype)
    with adapted(args), world_of_one():
        config = transformer_config(args)
        config.perform_initialization = False   # every parameter is overwritten
        model = build_model_chunks(args, config)[0]
        _fill(model, arch, reader, vocab, padded_vocab)
        checkpointing.save_checkpoint(root, 0, [model], None, _NoScheduler(), 0)
        if neutral_copy:
            from mindspeed.training.mindspore import neutral_format
            # whole tensors under the model's own names, fp32 (numpy has no bf16)
            arrays = {name: p.detach().float().numpy() for name, p in model.named_parameters()}
            neutral_format.save(root, 0, arrays, None, meta={"converted_from": "hf"})
