"""Writes a Megatron-Core checkpoint the way the built-in torch trainer does: its own GPTModel
(mindspeed.training.model) and its own torch_dist.save_checkpoint (torch_dist through
megatron.core.dist_checkpointing, iteration 0, tracker file). torch_dist stores every tensor with its
global shape, so the trainer loads it at any TP/PP (dist_checkpointing reshards on load); the target
TP only sets the vocabulary padding.

Streaming: everything runs in this one process, in a world of one gloo rank, and the trainer's
model is built on the meta device (names, shapes, Megatron's sharded state dict: no memory).
dist_checkpointing saves that state dict through torch_dist_stream, which asks `Producer` for each
chunk just before writing it; the producer reads the Hugging Face tensors of one decoder layer at a
time. Peak memory: one decoder layer converted (plus one Hugging Face tensor being read), or the
embedding / output layer when larger -- not the model. The neutral copy is written the same way
(neutral.save_streaming), in fp32.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

import mindspeed
from mindspeed.session import Session
from mindspeed.checkpoint import neutral
from mindspeed.checkpoint.megatron_read import model_name
from mindspeed.convert import layout
from mindspeed.convert.arch import Arch
from mindspeed.errors import ConvertError
from mindspeed.convert.hf_io import HFReader
from mindspeed.flags.trainer_flags import parse_args
from mindspeed.net import free_port

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
def adapted(args, session: Session | None = None):
    """The Session of MindSpeed's device shim (CPU stand-ins for Megatron's CUDA-only calls) and the
    features of `args`, as the trainer has them, undone at the end; a given `session` is used as is."""
    if session is not None:
        yield session
        return
    session = mindspeed.adapt(args)
    try:
        yield session
    finally:
        session.close()


def trainer_args(arch: Arch, vocab: int, padded_vocab: int, params_dtype: str):
    args = parse_args(arch.trainer_flags() + DTYPE_FLAGS[params_dtype] +
                      ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab - 1),
                       "--seq-length", "16", "--mock-data", "--backend", "torch", "--device", "cpu"], world_size=1)
    args.padded_vocab_size = padded_vocab
    return args


class Producer:
    """Whole converted tensors by trainer name, one decoder layer kept at a time; the data of a
    torch_dist chunk (its slice of the whole tensor) for the streaming writer."""

    def __init__(self, arch: Arch, reader: HFReader, vocab: int, padded_vocab: int):
        self.arch, self.reader, self.vocab, self.padded = arch, reader, vocab, padded_vocab
        self._layer, self._tensors = None, {}

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        if self._layer != i:
            self._tensors = {}     # drop the previous layer before reading the next
            hf = {name: self.reader.get(name) for name in layout.hf_layer_names(self.arch, i)}
            self._tensors, self._layer = layout.hf_to_mg_layer(self.arch, i, hf), i
        return self._tensors

    def whole(self, name: str) -> torch.Tensor:
        """The converted tensor of the trainer's parameter `name` (model-local)."""
        keep = min(self.vocab, self.arch.vocab_size)
        for prefix, first in (("decoder.layers.", 0), ("mtp.layers.", self.arch.num_layers)):
            if not name.startswith(prefix):
                continue
            i, suffix = name[len(prefix):].split(".", 1)
            tensors = self.layer(first + int(i))      # MTP layer j: Hugging Face's layer num_layers + j
            if suffix not in tensors:
                raise ConvertError(f"the trainer's model has a parameter the conversion does not fill: {name}")
            return tensors[suffix]
        if name == "embedding.word_embeddings.weight":
            return layout.fit_vocab(self.reader.get("model.embed_tokens.weight"), keep, self.padded)
        if name == "output_layer.weight" and not self.arch.tied_embeddings:
            return layout.fit_vocab(self.reader.get("lm_head.weight"), keep, self.padded)
        if name == "decoder.final_layernorm.weight":
            return self.reader.get("model.norm.weight")
        raise ConvertError(f"the trainer's model has a parameter the conversion does not fill: {name}")

    def chunk(self, sh) -> torch.Tensor:
        """The data of torch_dist chunk `sh` (a ShardedTensor of the trainer's sharded state dict): decoder
        layers stacked over the layers or one key per layer, each expert's weights stacked over the experts."""
        pre = sh.prepend_axis_num
        whole = self.whole(model_name(sh.key, tuple(sh.global_offset[:pre])))
        if tuple(whole.shape) != tuple(sh.global_shape[pre:]):
            raise ConvertError(f"{sh.key}: converted shape {tuple(whole.shape)} does not fit the model's "
                               f"{tuple(sh.global_shape[pre:])}")
        return whole[tuple(slice(o, o + n) for o, n in zip(sh.global_offset[pre:], sh.local_shape))]


def write_megatron(root: str, arch: Arch, reader: HFReader, vocab: int, padded_vocab: int, params_dtype: str,
                   neutral_copy: bool = False) -> None:
    """Save the model converted from `reader` as the trainer's iteration 0 under `root`, its
    embedding/output rows cut to the tokenizer's `vocab` and padded to `padded_vocab`; with
    neutral_copy, the same weights also as the MindSpore trainer's framework-neutral safetensors
    in the same iteration directory (each trainer reads only its own files there)."""
    from mindspeed.convert.torch_dist_stream import StreamingTorchDistSave  # Megatron-Core: after hf_to_mg's checks
    from mindspeed.checkpoint import torch_dist  # imports Megatron-Core (as above)
    from mindspeed.training.model import build_model_chunks, transformer_config  # imports Megatron-Core (as above)
    args = trainer_args(arch, vocab, padded_vocab, params_dtype)
    with adapted(args), world_of_one():
        config = transformer_config(args)
        config.perform_initialization = False
        config.use_cpu_initialization = True      # Megatron then names no device, so the meta one holds
        with torch.device("meta"):        # the model's structure only: its data is streamed
            model = build_model_chunks(args, config)[0]      # the structure only: no fused module matters
        producer = Producer(arch, reader, vocab, padded_vocab)
        torch_dist.save_checkpoint(root, 0, [model], None, _NoScheduler(), 0,
                                      sharded_strategy=StreamingTorchDistSave(producer.chunk))
        if neutral_copy:
            # whole tensors under the model's own names, fp32 (numpy has no bf16), written one at a time
            shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
            neutral.save_streaming(root, 0, shapes,
                                          lambda name: producer.whole(name).float().numpy(),
                                          meta={"converted_from": "hf"})
