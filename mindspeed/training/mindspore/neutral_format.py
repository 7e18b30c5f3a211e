"""Framework-neutral GPT checkpoints: safetensors files of numpy arrays, Megatron-Core names.

The tensors are stored whole (not sharded by tensor parallelism) under the names Megatron-Core's
GPTModel uses in its state dict (local layer spec), so either backend at any TP size can load
them: `shard_for_rank` cuts the tensor a TP rank holds, `unshard` joins them back. Needs numpy and
safetensors only. Files are written 0640 in 0750 directories; loading never unpickles anything.
"""
from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import load_file, save_file

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
META_FILE = "meta.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"

# how a whole tensor is split across TP ranks (Megatron-Core's parallel layers)
ROW_SPLIT = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight",
             "self_attention.linear_qkv.bias")
COLUMN_SPLIT = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
GATED_SPLIT = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")   # [gate; up]: each half split by rows, rank r holds [gate_r; up_r]


def layer_name(i: int, suffix: str) -> str:
    return f"decoder.layers.{i}.{suffix}"


def split_kind(name: str) -> str:
    if name.endswith(GATED_SPLIT):
        return "gated"
    if name.endswith(ROW_SPLIT):
        return "row"
    if name.endswith(COLUMN_SPLIT):
        return "column"
    return "replicated"


def shard_for_rank(name: str, full: np.ndarray, tp_rank: int, tp_size: int) -> np.ndarray:
    kind = split_kind(name)
    if kind == "replicated" or tp_size == 1:
        return full
    if kind == "gated":
        gate, up = np.split(full, 2, axis=0)
        return np.concatenate([np.split(gate, tp_size, 0)[tp_rank], np.split(up, tp_size, 0)[tp_rank]], 0)
    return np.split(full, tp_size, axis=0 if kind == "row" else 1)[tp_rank]


def unshard(name: str, shards: list[np.ndarray]) -> np.ndarray:
    kind = split_kind(name)
    if kind == "replicated" or len(shards) == 1:
        return shards[0]
    if kind == "gated":
        halves = [np.split(s, 2, axis=0) for s in shards]
        return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], 0)
    return np.concatenate(shards, axis=0 if kind == "row" else 1)


def _private_dir(path: str) -> None:
    os.makedirs(path, mode=0o750, exist_ok=True)
    os.chmod(path, 0o750)


def _write_private(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.chmod(tmp, 0o640)
    os.replace(tmp, path)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def save(root: str, iteration: int, model: dict, optimizer: dict | None = None, meta: dict | None = None) -> str:
    """Write model (and optimizer) arrays plus meta.json, then point the tracker file at them."""
    _private_dir(root)
    directory = iteration_dir(root, iteration)
    _private_dir(directory)
    _write_private(os.path.join(directory, MODEL_FILE),
                   lambda p: save_file({k: np.ascontiguousarray(v) for k, v in model.items()}, p))
    if optimizer is not None:
        _write_private(os.path.join(directory, OPTIMIZER_FILE),
                       lambda p: save_file({k: np.ascontiguousarray(v) for k, v in optimizer.items()}, p))
    meta = dict(meta or {}, iteration=iteration, format="mindspeed-neutral-v1")
    _write_private(os.path.join(directory, META_FILE), lambda p: _dump_json(meta, p))
    _write_private(os.path.join(root, TRACKER_FILE), lambda p: _dump_text(str(iteration), p))
    return directory


def _dump_json(obj, path):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)


def _dump_text(text, path):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def resolve(path: str) -> str:
    """An iteration directory from a checkpoint root (via the tracker file) or the directory itself."""
    if os.path.isfile(os.path.join(path, MODEL_FILE)):
        return path
    tracker = os.path.join(path, TRACKER_FILE)
    if not os.path.isfile(tracker):
        raise FileNotFoundError(f"{path!r} holds no MindSpeed neutral checkpoint (no {MODEL_FILE} and no {TRACKER_FILE})")
    with open(tracker, encoding="utf-8") as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"checkpoint tracker {tracker!r} is corrupt: {text!r}")
    directory = iteration_dir(path, int(text))
    if not os.path.isfile(os.path.join(directory, MODEL_FILE)):
        raise FileNotFoundError(f"checkpoint tracker points at {directory!r}, which has no {MODEL_FILE}")
    return directory


def load(path: str) -> tuple[dict, dict | None, dict]:
    """(model arrays, optimizer arrays or None, meta) from a root or iteration directory."""
    directory = resolve(path)
    model = load_file(os.path.join(directory, MODEL_FILE))
    opt_path = os.path.join(directory, OPTIMIZER_FILE)
    optimizer = load_file(opt_path) if os.path.isfile(opt_path) else None
    with open(os.path.join(directory, META_FILE), encoding="utf-8") as f:
        meta = json.load(f)
    return model, optimizer, meta


def megatron_state_dict_arrays(path: str, tp_rank: int = 0, tp_size: int = 1) -> dict:
    """The arrays a Megatron-Core GPTModel on TP rank `tp_rank` of `tp_size` holds, by state-dict
    name, from a neutral checkpoint. Torch side: `model.load_state_dict({k: torch.from_numpy(v)
    for k, v in arrays.items()}, strict=False)` (strict=False for Megatron's _extra_state entries)."""
    model, _, _ = load(path)
    return {name: shard_for_rank(name, full, tp_rank, tp_size) for name, full in model.items()}


def full_arrays_from_shards(shards_by_rank: list[dict]) -> dict:
    """Whole tensors from per-TP-rank state dicts of numpy arrays (Megatron names)."""
    names = shards_by_rank[0].keys()
    return {name: unshard(name, [s[name] for s in shards_by_rank]) for name in names}
