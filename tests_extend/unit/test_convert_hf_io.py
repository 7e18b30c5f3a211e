"""safetensors in and out: one file, or shards with Hugging Face's index (read back as written)."""
from __future__ import annotations

import json
import os

import torch

from mindspeed.convert.hf_io import INDEX_FILE, SINGLE_FILE, HFReader, HFWriter


def _write(out_dir, tensors, shard_bytes):
    writer = HFWriter(str(out_dir), shard_bytes=shard_bytes)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.finish()


def _read(out_dir):
    reader = HFReader(str(out_dir))
    try:
        return {name: reader.get(name) for name in reader.names()}
    finally:
        reader.close()


TENSORS = {f"model.layers.{i}.w": torch.randn(16, 8) for i in range(5)}
TENSORS["model.norm.weight"] = torch.ones(8, dtype=torch.bfloat16)


def test_shards_and_index(tmp_path):
    _write(tmp_path, TENSORS, shard_bytes=1200)   # two 512-byte tensors per shard
    files = sorted(os.listdir(tmp_path))
    assert INDEX_FILE in files and SINGLE_FILE not in files
    assert [f for f in files if f.endswith(".safetensors")] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(TENSORS)
    back = _read(tmp_path)
    assert all(torch.equal(back[n], t) and back[n].dtype == t.dtype for n, t in TENSORS.items())


def test_one_file_when_it_fits(tmp_path):
    _write(tmp_path, TENSORS, shard_bytes=2**20)
    assert sorted(os.listdir(tmp_path)) == [SINGLE_FILE]
    back = _read(tmp_path)
    assert all(torch.equal(back[n], t) for n, t in TENSORS.items())
