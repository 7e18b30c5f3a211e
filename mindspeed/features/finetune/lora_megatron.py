"""LoRA adapters on Megatron-Core's tensor-parallel linears: the torch backend's side of --lora-*.

An adapter adds scale * B(A(x)) (scale = alpha / r) to its linear's output and is split across
tensor-parallel ranks as the linear is. On a column-parallel linear (linear_qkv, linear_fc1) A is
whole on every rank and B holds this rank's output rows; on a row-parallel one (linear_proj,
linear_fc2) A holds this rank's input columns and B is whole. What crosses ranks is the rank-r
activation between A and B, with the same collectives Megatron's layers use (and, under
--sequence-parallel, the replicated factor is tagged so Megatron all-reduces its gradient).

Every base parameter is frozen before Megatron's DDP and optimizer are built, so they hold only the
adapters. `merge` folds each adapter into its linear's weight (weight += scale * B @ A per rank).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import layers
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from mindspeed.features.finetune.lora import adapter_settings

LAYERS = "megatron.core.tensor_parallel.layers"
ADAPTER = "lora"            # the adapter's child-module name under its linear
PARALLEL_LINEARS = (layers.ColumnParallelLinear, layers.RowParallelLinear)


class LoraAdapter(torch.nn.Module):
    def __init__(self, linear, r: int, alpha: float, gated: bool):
        super().__init__()
        self.column = isinstance(linear, layers.ColumnParallelLinear)
        if self.column and linear.gather_output:
            raise ValueError("LoRA on a column-parallel linear that gathers its output is not supported")
        self.scale = alpha / r
        self.tp_group = linear.tp_group
        self.sequence_parallel = linear.sequence_parallel
        self.gated = gated          # a gated MLP's linear_fc1: each rank's rows are [its gate; its up]
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        weight = linear.weight
        # A is drawn whole from the default generator, which every tensor-parallel rank seeds alike:
        # the row-parallel shards then join into the same A at any TP size
        a = torch.empty(r, linear.input_size, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        if self.column:
            b_rows = linear.output_size_per_partition
        else:
            width = linear.input_size // tp
            a, b_rows = a[:, rank * width:(rank + 1) * width], linear.output_size
        self.A = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
        self.B = torch.nn.Parameter(torch.zeros(b_rows, r, device=weight.device, dtype=weight.dtype))
        sharded, whole = (self.B, self.A) if self.column else (self.A, self.B)
        layers.set_tensor_model_parallel_attributes(sharded, True, 0 if self.column else 1, 1)
        if self.sequence_parallel:
            # its gradient is a sum over this rank's sequence chunk only
            setattr(whole, "sequence_parallel", True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.A)
        if self.column:        # gradients reaching h are partial sums over the ranks' rows of B
            h = gather_from_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel \
                else copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        else:                  # h is a partial sum over the ranks' input columns
            h = reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel \
                else reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, self.B) * self.scale

    def delta(self) -> torch.Tensor:
        """What merging adds to this rank's shard of the linear's weight."""
        return (self.B.float() @ self.A.float()) * self.scale

    def sharded_state_dict(self, prefix: str, sharded_offsets, metadata) -> dict:
        state = make_sharded_tensors_for_checkpoint(
            {"A": self.A, "B": self.B}, prefix, {"B": 0} if self.column else {"A": 1}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if self.gated:      # stored as the whole layer's [gate; up], as Megatron stores linear_fc1
            state[f"{prefix}B"] = apply_swiglu_sharded_factory(
                state[f"{prefix}B"], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
        return state


def adapter_of(linear) -> LoraAdapter | None:
    return linear._modules.get(ADAPTER)


def is_adapter_key(key: str) -> bool:
    """A model state key (or sharded key) of an adapter tensor."""
    return f".{ADAPTER}." in key


def _forward_with_adapter(original):
    def forward(self, input_, *args, **kwargs):
        output, bias = original(self, input_, *args, **kwargs)
        adapter = adapter_of(self)
        if adapter is not None:
            output = output + adapter(input_).to(output.dtype)
        return output, bias
    return forward


def _sharded_with_adapter(original):
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = original(self, prefix, sharded_offsets, metadata)
        adapter = adapter_of(self)
        if adapter is not None:     # Megatron's own method takes the adapter's tensors as replicated
            for key in [k for k in state if k.startswith(f"{prefix}{ADAPTER}.")]:
                del state[key]
            state.update(adapter.sharded_state_dict(f"{prefix}{ADAPTER}.", sharded_offsets, metadata))
        return state
    return sharded_state_dict


class LoraModel:
    """The trainer's handle on the feature (the "lora" part)."""

    def __init__(self, args):
        self.targets = tuple(args.lora_target_modules)
        self.r, self.alpha = args.lora_r, args.lora_alpha
        self.settings = adapter_settings(args)
        self.lora_load = args.lora_load

    is_adapter_key = staticmethod(is_adapter_key)

    def attach(self, chunks) -> int:
        """Freeze every parameter of the model chunks and give each target linear an adapter;
        returns the number of adapters."""
        count = 0
        for chunk in chunks:
            for param in chunk.parameters():
                param.requires_grad_(False)
            found = [(name, m) for name, m in chunk.named_modules()
                     if name.rsplit(".", 1)[-1] in self.targets and isinstance(m, PARALLEL_LINEARS)]
            for name, linear in found:
                gated = name.endswith("linear_fc1") and linear.config.gated_linear_unit
                linear.add_module(ADAPTER, LoraAdapter(linear, self.r, self.alpha, gated))
            count += len(found)
        if count == 0:
            raise ValueError(f"--lora-target-modules {' '.join(self.targets)}: no such tensor-parallel linear "
                             "in this model")
        return count


def merge(chunks) -> int:
    """Fold every adapter into its linear's weight and remove it; returns how many were merged."""
    merged = 0
    with torch.no_grad():
        for chunk in chunks:
            for module in list(chunk.modules()):
                adapter = adapter_of(module) if isinstance(module, PARALLEL_LINEARS) else None
                if adapter is None:
                    continue
                module.weight.add_(adapter.delta().to(module.weight.dtype))
                del module._modules[ADAPTER]
                merged += 1
    return merged


def install(patcher, args) -> LoraModel:
    why = "--lora-target-modules: the linear's LoRA adapter"
    for cls in ("ColumnParallelLinear", "RowParallelLinear"):
        patcher.wrap(f"{LAYERS}.{cls}.forward", _forward_with_adapter, reason=why)
        patcher.wrap(f"{LAYERS}.{cls}.sharded_state_dict", _sharded_with_adapter, reason=why)
    return LoraModel(args)
