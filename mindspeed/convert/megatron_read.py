"""Reads tensors out of a torch_dist checkpoint (the built-in trainer's, at any TP/PP) without a
process group and one piece at a time.

torch.distributed.checkpoint keeps, per tensor, its global shape and the chunks each saving rank
wrote (offset, size), each chunk a torch.save blob at a byte range of a .distcp file. Reading a
tensor -- or one decoder layer of a layer-stacked tensor -- is reading the chunks that overlap it
and placing them at their offsets: this undoes the TP split and the PP split at once.
Peak memory: the largest tensor asked for (one layer's slice of the stacked ones).
"""
from __future__ import annotations

import io
import os

import torch

from mindspeed.convert.errors import ConvertError
from mindspeed.training import checkpointing
from mindspeed.training.checkpoint_scan import iteration_dir
from mindspeed.training.errors import CheckpointError


class MegatronReader:
    def __init__(self, root: str):
        try:
            iteration = checkpointing.read_tracker(root)
        except CheckpointError as err:
            raise ConvertError(str(err)) from None
        self.dir = iteration_dir(root, iteration)
        index = checkpointing.read_index(self.dir)
        self.meta = index.state_dict_metadata
        self.pieces: dict[str, list] = {}   # key -> [(chunk offsets, chunk sizes, storage info)]
        for mindex, info in index.storage_data.items():
            if getattr(info, "transform_descriptors", None):
                raise ConvertError(f"{self.dir}: {mindex.fqn} is stored transformed "
                                   f"({info.transform_descriptors}); only plain torch_dist files are read")
            if mindex.offset is not None:
                self.pieces.setdefault(mindex.fqn, []).append((tuple(mindex.offset), info))

    def has(self, key: str) -> bool:
        return key in self.pieces

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self.pieces:
            raise ConvertError(f"checkpoint {self.dir} has no tensor {key!r}")
        return tuple(self.meta[key].size)

    def get(self, key: str, layer: int | None = None) -> torch.Tensor:
        """The global tensor `key`, or its slice [layer] for layer-stacked keys."""
        shape = self.shape(key)
        meta = self.meta[key]
        out_shape = shape if layer is None else shape[1:]
        out = torch.empty(out_shape, dtype=meta.properties.dtype)
        filled = 0
        for offsets, info in self.pieces[key]:
            if layer is not None and offsets[0] != layer:
                continue
            chunk = self._read(info)
            if layer is not None:
                chunk, offsets = chunk[0], offsets[1:]
            region = tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape))
            out[region] = chunk
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
