"""A dist_checkpointing save strategy that writes Megatron's torch_dist files one tensor at a time.

Megatron's own torch_dist strategy needs every tensor of the state dict in memory before it writes
(it resolves the whole plan up front). The converter instead hands dist_checkpointing the trainer's
sharded state dict of a model built on the meta device (names, global shapes, offsets: no memory),
and this strategy asks `produce(sharded_tensor)` for each chunk's data just before writing it, so
peak memory is one chunk (plus what `produce` caches: one decoder layer). Megatron still writes
common.pt and metadata.json itself. The files are the ones torch.distributed.checkpoint writes in
one process (torch.save'd chunks in `__0_0.distcp`, a pickled Metadata index in `.metadata`), so
Megatron's loader, Megatron-LM and megatron_read.TorchDistReader read them as any other.
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Callable

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.filesystem import _StorageInfo

DATA_FILE = "__0_0.distcp"


class StreamingTorchDistSave(SaveShardedStrategy):
    def __init__(self, produce: Callable[[ShardedTensor], torch.Tensor]):
        super().__init__("torch_dist", 1)
        self.produce = produce

    @property
    def can_handle_sharded_objects(self):
        return True

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        if torch.distributed.get_world_size() != 1:
            raise RuntimeError("the streaming torch_dist writer runs in a single process")
        items = [v for v in nested_values(sharded_state_dict) if is_main_replica(v.replica_id)]
        objects: dict[str, list] = {}
        for obj in (v for v in items if isinstance(v, ShardedObject)):
            objects.setdefault(obj.unique_key, []).append(obj.data)
        tensors = [v for v in items if isinstance(v, ShardedTensor)]
        tensor_md: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        with open(os.path.join(checkpoint_dir, DATA_FILE), "wb") as stream:
            for key, datas in objects.items():      # as Megatron: a list of the objects' data, torch.save'd
                buf = io.BytesIO()
                torch.save(datas, buf)
                offset = stream.tell()
                stream.write(buf.getbuffer())
                tensor_md[key] = BytesStorageMetadata()
                storage[MetadataIndex(key)] = _StorageInfo(DATA_FILE, offset, stream.tell() - offset)
            for sh in tensors:
                if sh.flattened_range is not None:
                    raise RuntimeError(f"{sh.key}: flattened chunks are not written by the streaming writer")
                data = self.produce(sh)
                want = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
                data = data.to(sh.dtype).reshape(want).contiguous()
                if data.untyped_storage().nbytes() != data.nbytes:
                    data = data.clone()    # torch.save writes a view's whole storage (fc1's gate half: all of fc1)
                offset = stream.tell()
                torch.save(data, stream)
                offsets = torch.Size(sh.global_offset)
                storage[MetadataIndex(sh.key, offsets)] = _StorageInfo(DATA_FILE, offset, stream.tell() - offset)
                md = tensor_md.setdefault(sh.key, TensorStorageMetadata(
                    TensorProperties(dtype=sh.dtype), torch.Size(sh.global_shape), []))
                md.chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(want)))
                del data
        metadata = Metadata(state_dict_metadata=tensor_md, storage_data=storage)
        metadata.version = "1.0.0"
        with open(os.path.join(checkpoint_dir, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)
