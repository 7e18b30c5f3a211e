"""Reads the trainers' checkpoints one tensor (or one decoder layer) at a time, without a process
group, under the model's own parameter names:

- the torch trainer's torch_dist (at any TP/PP): torch.distributed.checkpoint keeps, per tensor, its
  global shape and the chunks each saving rank wrote (offset, size), each chunk a torch.save blob at
  a byte range of a .distcp file. Reading a tensor -- or one layer of a layer-stacked tensor -- is
  reading the chunks that overlap it and placing them at their offsets, which undoes the TP split
  and the PP split at once.
- the MindSpore trainer's framework-neutral safetensors (whole tensors under the model's names),
  memory-mapped.

Peak memory: the largest tensor asked for (one layer's slice of the stacked ones).
"""
from __future__ import annotations

import io
import os

import torch

from mindspeed.errors import ConvertError
from mindspeed.checkpoint.neutral import MODEL_FILE
from mindspeed.checkpoint.scan import iteration_dir
from mindspeed.errors import CheckpointError

STACKED = "decoder.layers."   # torch_dist keys of decoder layers: one tensor stacked over the layers
# a decoder layer's parameters (model-local suffixes) -> their torch_dist key. Megatron-Core stores
# the local spec's norms under Transformer Engine's fused names, for compatibility between specs.
LAYER_KEYS = {
    "input_layernorm.weight": STACKED + "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": STACKED + "mlp.linear_fc1.layer_norm_weight",
    "self_attention.linear_qkv.weight": STACKED + "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias": STACKED + "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight": STACKED + "self_attention.linear_proj.weight",
    "mlp.linear_fc1.weight": STACKED + "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight": STACKED + "mlp.linear_fc2.weight",
}
LAYER_SUFFIXES = tuple(LAYER_KEYS)


def open_checkpoint(root: str):
    """The reader for the iteration the tracker names, checked as the trainers check it before a
    load: torch_dist when the directory holds one (it keeps the parameters' dtype), else the
    MindSpore trainer's neutral safetensors."""
    from mindspeed.checkpoint import torch_dist  # imports Megatron-Core: mg->hf conversion reads with torch alone
    try:
        directory = iteration_dir(root, torch_dist.read_tracker(root))   # checks either format
    except CheckpointError as err:
        raise ConvertError(str(err)) from None
    return NeutralReader(directory) if torch_dist.is_neutral(directory) else TorchDistReader(directory)


class TorchDistReader:
    def __init__(self, directory: str):
        from mindspeed.checkpoint.torch_dist import read_index  # imports Megatron-Core (see open_checkpoint)
        self.dir = directory
        index = read_index(directory)
        self.meta = index.state_dict_metadata
        self.pieces: dict[str, list] = {}   # key -> [(chunk offsets, storage info)]
        for mindex, info in index.storage_data.items():
            if getattr(info, "transform_descriptors", None):
                raise ConvertError(f"{directory}: {mindex.fqn} is stored transformed "
                                   f"({info.transform_descriptors}); only plain torch_dist files are read")
            if mindex.offset is not None:
                self.pieces.setdefault(mindex.fqn, []).append((tuple(mindex.offset), info))

    # model-local names ------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.pieces

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.pieces:
            raise ConvertError(f"checkpoint {self.dir} has no tensor {name!r}")
        return tuple(self.meta[name].size)

    def get(self, name: str) -> torch.Tensor:
        return self._assemble(name, None)

    def has_layer(self, suffix: str) -> bool:
        return self.has(LAYER_KEYS[suffix])

    def num_layers(self) -> int:
        return self.shape(LAYER_KEYS["self_attention.linear_qkv.weight"])[0]

    def layer_shape(self, suffix: str) -> tuple[int, ...]:
        return self.shape(LAYER_KEYS[suffix])[1:]

    def get_layer(self, suffix: str, layer: int) -> torch.Tensor:
        return self._assemble(LAYER_KEYS[suffix], layer)

    def layer_tensor(self, key: str, layer: int) -> torch.Tensor:
        """Layer `layer` of the layer-stacked tensor `key` (a torch_dist key)."""
        return self._assemble(key, layer)

    # chunks -----------------------------------------------------------------------------------
    def _assemble(self, key: str, layer: int | None) -> torch.Tensor:
        """The global tensor `key`, or its slice [layer] for layer-stacked keys."""
        shape = self.shape(key)
        out = torch.empty(shape if layer is None else shape[1:], dtype=self.meta[key].properties.dtype)
        filled = 0
        for offsets, info in self.pieces[key]:
            if layer is not None and offsets[0] != layer:
                continue
            chunk = self._read(info)
            if layer is not None:
                chunk, offsets = chunk[0], offsets[1:]
            out[tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape))] = chunk
            filled += chunk.numel()
        if filled != out.numel():   # chunks never overlap in torch_dist (replicas are written once)
            raise ConvertError(f"checkpoint {self.dir}: the chunks of {key!r}"
                               f"{'' if layer is None else f' layer {layer}'} cover {filled} of "
                               f"{out.numel()} values")
        return out

    def _read(self, info) -> torch.Tensor:
        with open(os.path.join(self.dir, info.relative_path), "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


class NeutralReader:
    """The MindSpore trainer's model.safetensors: whole tensors under the model-local names."""

    def __init__(self, directory: str):
        from safetensors import safe_open
        self.dir = directory
        self._file = safe_open(os.path.join(directory, MODEL_FILE), framework="pt")
        self._names = set(self._file.keys())

    def has(self, name: str) -> bool:
        return name in self._names

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._names:
            raise ConvertError(f"checkpoint {self.dir} has no tensor {name!r}")
        return tuple(self._file.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        self.shape(name)
        return self._file.get_tensor(name)

    def has_layer(self, suffix: str) -> bool:
        return self.has(f"decoder.layers.0.{suffix}")

    def num_layers(self) -> int:
        return sum(1 for n in self._names if n.endswith(".self_attention.linear_qkv.weight"))

    def layer_shape(self, suffix: str) -> tuple[int, ...]:
        return self.shape(f"decoder.layers.0.{suffix}")

    def get_layer(self, suffix: str, layer: int) -> torch.Tensor:
        return self.get(f"decoder.layers.{layer}.{suffix}")
