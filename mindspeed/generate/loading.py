"""A checkpoint's model on this launch's processes: process groups, then the trainer's own model
builder (mindspeed.training.model) and checkpoint loader (mindspeed.checkpoint.torch_dist: a
torch_dist checkpoint, or the MindSpore trainer's neutral one through cross_format), weights only."""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import torch
from megatron.core import parallel_state, tensor_parallel

from mindspeed.checkpoint import ema_weights, torch_dist
from mindspeed.features.finetune import lora_megatron
from mindspeed.training import pretrain
from mindspeed.training.model import build_model_chunks, transformer_config


def start_processes(args) -> None:
    """The process groups of a TP-only launch (a world of one without torchrun), seeded as the trainer."""
    pretrain._init_distributed(args, args.device_name)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


def stop_processes() -> None:
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def load_model(args, step: int | None = None, lora=None, spec_modules=None, use_ema: bool = False):
    """The model chunk of this rank with the checkpoint's weights (--load, iteration `step` or the
    latest). `lora`: the LoRA feature's part (its --lora-load adapters are loaded, then folded into
    the weights, so generation runs the plain linears); `spec_modules`: the session's layer-spec modules
    (training/layer_spec.SpecModules); `use_ema`: the checkpoint's EMA of the weights instead (--use-ema)."""
    chunks = build_model_chunks(args, transformer_config(args), spec_modules)
    if lora is not None:
        lora.attach(chunks)
    for chunk in chunks:
        chunk.to(args.device_name)
    base = None if lora is None else (lambda name: not lora.is_adapter_key(name))
    torch_dist.load_checkpoint(args.load, chunks, None, None, finetune=True, step=step, only=base)
    if use_ema:
        ema_weights.load_ema_weights(args.load, chunks, step)
    if lora is not None:
        torch_dist.load_checkpoint(lora.lora_load, chunks, None, None, finetune=True, only=lora.is_adapter_key)
        lora_megatron.merge(chunks)
    return chunks


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


@contextmanager
def quiet_frameworks():
    """Megatron and torch warn at import and model build about Apex / Transformer Engine and CUDA
    settings that loading never uses: a user's output (and a refusal) stays readable."""
    with warnings.catch_warnings():
        for category in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
        yield
