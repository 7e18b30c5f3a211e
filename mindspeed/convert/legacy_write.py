"""Writes the converted model as Megatron-LM's legacy per-rank checkpoint (--ckpt-format torch), the
layout legacy.py saves and loads: iter_0000000/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt for every
tensor-, pipeline- and expert-parallel rank of the target sizes, each with that rank's own tensors
(layers numbered within their stage, experts within their expert-parallel rank, tensors cut for the TP
rank: checkpoint.legacy_layout), the run's `args` with those sizes, and no optimizer or RNG state (load
it with --finetune, as any converted checkpoint). With --moe-grouped-gemm a rank's experts are
GroupedMLP's weight1/weight2.

Memory: one pipeline stage's tensors for all its ranks at a time (a legacy file is one torch.save).
"""
from __future__ import annotations

import os

import torch

from mindspeed.checkpoint import legacy, legacy_layout
from mindspeed.checkpoint.scan import iteration_dir
from mindspeed.convert import layout
from mindspeed.convert.arch import Arch
from mindspeed.convert.megatron_write import Producer, trainer_args
from mindspeed.files import atomic_write_text

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def stage_layers(num_layers: int, pp: int, layer_list: list[int] | None) -> list[range]:
    """The decoder layers of each pipeline stage (--num-layer-list, else an even split)."""
    counts = layer_list or [num_layers // pp] * pp
    starts = [sum(counts[:p]) for p in range(pp)]
    return [range(s, s + c) for s, c in zip(starts, counts)]


class _StageFiles:
    """The model dicts of one pipeline stage's ranks: {(tp, ep): {name: tensor}}."""

    def __init__(self, tp: int, ep: int, dtype: torch.dtype):
        self.tp, self.ep, self.dtype = tp, ep, dtype
        self.models = {(t, e): {} for t in range(tp) for e in range(ep)}

    def add(self, name: str, whole: torch.Tensor, ep_rank: int | None = None) -> None:
        """`whole` cut for each TP rank, into expert-parallel rank ep_rank's files (every one's with None)."""
        for t in range(self.tp):
            part = legacy_layout.tp_slice(name, whole, t, self.tp).to(self.dtype).clone()
            for e in range(self.ep) if ep_rank is None else (ep_rank,):
                self.models[(t, e)][name] = part


def _add_block(files: _StageFiles, arch: Arch, prefix: str, tensors: dict, ep: int, grouped: bool) -> None:
    """One decoder (or MTP) layer's whole tensors under `prefix`, experts spread over the EP ranks."""
    local = arch.num_experts // ep if arch.num_experts else 0
    experts: dict[tuple[str, int], torch.Tensor] = {}
    head = ""
    for suffix, whole in tensors.items():
        head_here, sep, rest = suffix.partition(layout.EXPERT)
        if not sep:
            files.add(prefix + suffix, whole)
            continue
        expert, name = rest.split(".", 1)
        head, e = head_here, int(expert)
        if grouped:
            experts[(name, e)] = whole
        else:
            files.add(f"{prefix}{head}{layout.EXPERT}{e % local}.{name}", whole, ep_rank=e // local)
    if experts:
        _add_grouped(files, f"{prefix}{head}mlp.experts.", experts, ep, local)


def _add_grouped(files: _StageFiles, prefix: str, experts: dict, ep: int, local: int) -> None:
    """GroupedMLP's weight1/weight2 of each rank from the experts' whole fc1/fc2 {(name, expert): tensor}."""
    for e_rank in range(ep):
        mine = range(e_rank * local, (e_rank + 1) * local)
        for t in range(files.tp):
            fc1, fc2 = ([legacy_layout.tp_slice(name, experts[(name, e)], t, files.tp) for e in mine]
                        for name in ("linear_fc1.weight", "linear_fc2.weight"))
            weight1, weight2 = legacy_layout.group_experts(fc1, fc2)
            model = files.models[(t, e_rank)]
            model[prefix + "weight1"], model[prefix + "weight2"] = weight1.to(files.dtype), weight2.to(files.dtype)


def write_legacy(root: str, arch: Arch, reader, vocab: int, padded_vocab: int, params_dtype: str, tp: int,
                 pp: int, ep: int, layer_list: list[int] | None, grouped: bool) -> None:
    """Save the model converted from `reader` as iteration 0 of a legacy checkpoint under `root` for
    TP x PP x EP ranks (the pipeline split of `layer_list`, else even)."""
    args = trainer_args(arch, vocab, padded_vocab, params_dtype)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.expert_model_parallel_size, args.moe_grouped_gemm = ep, grouped
    saved_args = legacy.saved_args(args, 0, 0)
    producer = Producer(arch, reader, vocab, padded_vocab)
    directory = iteration_dir(root, 0)
    for p, layers in enumerate(stage_layers(arch.num_layers, pp, layer_list)):
        files = _StageFiles(tp, ep, DTYPES[params_dtype])
        if p == 0:
            files.add("embedding.word_embeddings.weight", producer.whole("embedding.word_embeddings.weight"))
        for local, i in enumerate(layers):
            _add_block(files, arch, f"decoder.layers.{local}.", producer.layer(i), ep, grouped)
        if p == pp - 1:
            for j in range(arch.mtp_layers):
                _add_block(files, arch, f"mtp.layers.{j}.", producer.layer(arch.num_layers + j), ep, grouped)
            files.add("decoder.final_layernorm.weight", producer.whole("decoder.final_layernorm.weight"))
            if not arch.tied_embeddings or pp > 1:    # a tied output layer's copy lives on the last stage
                head = "embedding.word_embeddings.weight" if arch.tied_embeddings else "output_layer.weight"
                files.add("output_layer.weight", producer.whole(head))
        for (t, e), model in files.models.items():
            rank_dir = os.path.join(directory, legacy.rank_dir_name(t, p, e, pp, ep))
            os.makedirs(rank_dir)
            torch.save({"args": saved_args, "checkpoint_version": legacy.CHECKPOINT_VERSION, "iteration": 0,
                        "model": model}, os.path.join(rank_dir, legacy.MODEL_FILE))
    atomic_write_text(os.path.join(root, legacy.TRACKER), "0", legacy.FILE_MODE)
