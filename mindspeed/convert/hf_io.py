"""Hugging Face checkpoint files: safetensors weights (one file or shards with an index) read one
tensor at a time, and written shard by shard.

safetensors' `safe_open` checks each file and gives the names, shapes and dtypes; the bytes of a
tensor are then read with a plain file read into a fresh buffer instead of through safe_open's
memory map: pages of a map stay resident (and count in the process's memory) for as long as the
file is open, so reading a whole model through it would hold the whole model."""
from __future__ import annotations

import json
import os
import shutil
import struct
from contextlib import ExitStack

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mindspeed.errors import ConvertError

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# the files next to the weights that describe the model and its tokenizer (copied as they are)
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "tokenizer.model", "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
              "chat_template.jinja")


class HFReader:
    """Tensors of a Hugging Face model directory by name; each read maps only that tensor."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        self.where = self._weight_map()
        self._stack = ExitStack()
        self._open: dict[str, object] = {}
        self._headers: dict[str, tuple[int, dict]] = {}

    def _weight_map(self) -> dict[str, str]:
        index = os.path.join(self.dir, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    return dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ConvertError(f"{index} is not a safetensors index ({err})") from None
        single = os.path.join(self.dir, SINGLE_FILE)
        if not os.path.isfile(single):
            raise ConvertError(f"{self.dir} holds neither {SINGLE_FILE} nor {INDEX_FILE} "
                               "(only safetensors weights convert)")
        with _open_safetensors(single) as f:
            return {name: SINGLE_FILE for name in f.keys()}

    def _file(self, name: str):
        fname = self.where[name]
        if fname not in self._open:
            path = os.path.join(self.dir, fname)
            if not os.path.isfile(path):
                raise ConvertError(f"{path} is missing ({INDEX_FILE} lists it)")
            self._open[fname] = self._stack.enter_context(_open_safetensors(path))
        return self._open[fname]

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._file(name).get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self.get_rows(name, 0, None)

    def get_rows(self, name: str, start: int, stop: int | None) -> torch.Tensor:
        """Rows start:stop of the tensor's first dimension (the whole tensor with 0, None): a part
        of a large embedding without reading all of it."""
        self._file(name)          # checked by safe_open
        fname = self.where[name]
        if fname not in self._headers:
            self._headers[fname] = _read_header(os.path.join(self.dir, fname))
        data_start, header = self._headers[fname]
        entry = header[name]
        begin, end = entry["data_offsets"]
        dtype, shape = _DTYPES.get(entry["dtype"]), list(entry["shape"])
        if dtype is None:
            raise ConvertError(f"{name}: safetensors dtype {entry['dtype']} is not one a model's weights have")
        if (start, stop) != (0, None) and shape and shape[0]:
            row_bytes = (end - begin) // shape[0]
            stop = shape[0] if stop is None else min(stop, shape[0])
            start = min(start, stop)
            begin, end, shape[0] = begin + start * row_bytes, begin + stop * row_bytes, stop - start
        buf = bytearray(end - begin)
        with open(os.path.join(self.dir, fname), "rb") as f:
            f.seek(data_start + begin)
            if f.readinto(buf) != len(buf):
                raise ConvertError(f"{os.path.join(self.dir, fname)} is truncated (reading {name})")
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def close(self) -> None:
        self._stack.close()


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _read_header(path: str) -> tuple[int, dict]:
    """(where the data starts, the JSON header) of a safetensors file (already checked by safe_open)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return 8 + length, json.loads(f.read(length))


def _open_safetensors(path: str):
    try:
        return safe_open(path, framework="pt")
    except Exception as err:   # SafetensorError, OSError: a damaged or truncated file
        raise ConvertError(f"{path} is not a readable safetensors file ({err})") from None


class HFWriter:
    """Writes tensors into safetensors shards of at most `shard_bytes` (one model.safetensors when
    everything fits), holding at most one shard in memory, then the index."""

    def __init__(self, out_dir: str, shard_bytes: int = 5 * 2**30):
        self.dir, self.shard_bytes = out_dir, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []   # the tensor names of each written shard
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        tmp_name = f"shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, os.path.join(self.dir, tmp_name), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        if self.pending:
            self._flush()
        n = len(self.files)
        if n == 1:
            os.replace(os.path.join(self.dir, "shard-00000.safetensors"), os.path.join(self.dir, SINGLE_FILE))
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.dir, f"shard-{i:05d}.safetensors"), os.path.join(self.dir, final))
            weight_map.update({name: final for name in names})
        with open(os.path.join(self.dir, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)


def copy_side_files(src_dir: str, dst_dir: str, extra: tuple[str, ...] = ()) -> list[str]:
    """Copy config/tokenizer files that exist in src_dir (plus `extra` paths) into dst_dir."""
    copied = []
    for path in [os.path.join(src_dir, n) for n in SIDE_FILES] + list(extra):
        if os.path.isfile(path) and os.path.basename(path) not in copied:
            shutil.copyfile(path, os.path.join(dst_dir, os.path.basename(path)))
            copied.append(os.path.basename(path))
    return copied
