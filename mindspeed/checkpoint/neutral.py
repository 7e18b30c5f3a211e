"""Framework-neutral GPT checkpoints: safetensors files of numpy arrays, Megatron-Core names.

The tensors are stored whole (not sharded by tensor parallelism) under the names Megatron-Core's
GPTModel uses in its state dict (local layer spec), so either backend at any TP size can load
them: `shard_for_rank` cuts the tensor a TP rank holds, `unshard` joins them back. Needs numpy and
safetensors only. Files are written 0640 in 0750 directories; loading never unpickles anything.

Before a checkpoint is loaded its files are checked (`check_iteration`: each safetensors header
parsed and the file as long as the header says, meta.json parsed), so a truncated or damaged file
is refused with one line (CheckpointError) naming the file and the last readable iteration.
Loading writes nothing: the tracker file and the checkpoints stay as they are.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from mindspeed.files import PRIVATE_DIR, PRIVATE_FILE, atomic_write_text, private_dir
from mindspeed.checkpoint import scan
from mindspeed.checkpoint.scan import ITERATION_DIR, iteration_dir
from mindspeed.errors import CheckpointError, resume_hint, unreadable

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
META_FILE = "meta.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"

# how a whole tensor is split across TP ranks (Megatron-Core's parallel layers)
ROW_SPLIT = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight",
             "self_attention.linear_qkv.bias")
COLUMN_SPLIT = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
# --qk-layernorm: Megatron-Core's per-head query and key norms, modules of self_attention (the one spelling)
QK_NORMS = ("q_layernorm", "k_layernorm")
GATED_SPLIT = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")   # [gate; up]: each half split by rows, rank r holds [gate_r; up_r]
# (a GELU MLP's fc1, --no-swiglu, has no halves: gated=False splits it by rows like linear_qkv)


def layer_name(i: int, suffix: str) -> str:
    return f"decoder.layers.{i}.{suffix}"


# MoE: each expert's weights under its global index (Megatron's names at EP 1), whatever the EP size
EXPERTS = "mlp.experts.local_experts."


def expert_name(i: int, e: int, suffix: str) -> str:
    """The state-dict name of layer i's global expert e's weight."""
    return layer_name(i, f"{EXPERTS}{e}.{suffix}")


def is_expert(name: str) -> bool:
    return EXPERTS in name


def expert_of(name: str) -> int:
    return int(name.split(EXPERTS, 1)[1].split(".", 1)[0])


def expert_owner(e: int, num_experts: int, ep_size: int) -> int:
    """The expert-parallel rank holding global expert e: EP rank r holds a contiguous block."""
    return e // (num_experts // ep_size)


def split_kind(name: str, gated: bool = True, experts_sharded: bool = False) -> str:
    """experts_sharded: Megatron-Core's expert TP (expert_tensor_parallel_size = TP > 1): each expert's
    fc1 column-parallel and fc2 row-parallel over TP, split as the dense MLP's; else experts are whole."""
    if is_expert(name):
        if not experts_sharded:
            return "replicated"
        name = "mlp." + name.rsplit(".", 2)[-2] + ".weight"       # an expert's linear_fc1/fc2: the dense MLP's
    if name.endswith(GATED_SPLIT):
        return "gated" if gated else "row"
    if name.endswith(ROW_SPLIT):
        return "row"
    if name.endswith(COLUMN_SPLIT):
        return "column"
    return "replicated"


def shard_for_rank(name: str, full: np.ndarray, tp_rank: int, tp_size: int, gated: bool = True,
                   experts_sharded: bool = False) -> np.ndarray:
    kind = split_kind(name, gated, experts_sharded)
    if kind == "replicated" or tp_size == 1:
        return full
    if kind == "gated":
        gate, up = np.split(full, 2, axis=0)
        return np.concatenate([np.split(gate, tp_size, 0)[tp_rank], np.split(up, tp_size, 0)[tp_rank]], 0)
    return np.split(full, tp_size, axis=0 if kind == "row" else 1)[tp_rank]


def unshard(name: str, shards: list[np.ndarray], gated: bool = True, experts_sharded: bool = False) -> np.ndarray:
    kind = split_kind(name, gated, experts_sharded)
    if kind == "replicated" or len(shards) == 1:
        return shards[0]
    if kind == "gated":
        halves = [np.split(s, 2, axis=0) for s in shards]
        return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], 0)
    return np.concatenate(shards, axis=0 if kind == "row" else 1)






def save(root: str, iteration: int, model: dict, optimizer: dict | None = None, meta: dict | None = None) -> str:
    """Write model (and optimizer) arrays plus meta.json, then point the tracker file at them. A
    write that fails (a full disk) is one line; the tracker still names the last complete checkpoint."""
    try:
        staged = _new_iteration_dir(root, iteration)
        save_file({k: np.ascontiguousarray(v) for k, v in model.items()}, os.path.join(staged, MODEL_FILE))
        if optimizer is not None:
            save_file({k: np.ascontiguousarray(v) for k, v in optimizer.items()}, os.path.join(staged, OPTIMIZER_FILE))
        return _commit(root, staged, iteration, meta)
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"saving {iteration_dir(root, iteration)} failed: {_cause(err)} (the tracker still "
                              f"names the last complete checkpoint)") from None


def _cause(err: BaseException) -> str:
    # safetensors wraps the OS error in its own text: "Error while serializing: I/O error: <strerror> (os error N)"
    if isinstance(err, OSError):
        return err.strerror or str(err)
    return str(err).rsplit("I/O error: ", 1)[-1]


def _new_iteration_dir(root: str, iteration: int) -> str:
    """The empty directory a save of `iteration` writes into: iter_NNNNNNN.partial (scan)."""
    private_dir(root)
    return scan.fresh_staging_dir(root, iteration, PRIVATE_DIR)


def _commit(root: str, staged: str, iteration: int, meta: dict | None) -> str:
    """meta.json, the staged directory renamed into place, then the tracker: a reader never sees an
    iteration whose files are not all written. Returns the iteration's directory."""
    meta = dict(meta or {}, iteration=iteration, format="mindspeed-neutral-v1")
    _dump_json(meta, os.path.join(staged, META_FILE))
    for name in os.listdir(staged):
        os.chmod(os.path.join(staged, name), PRIVATE_FILE)
    directory = scan.publish(root, iteration)
    atomic_write_text(os.path.join(root, TRACKER_FILE), f"{iteration}\n")
    return directory


def save_streaming(root: str, iteration: int, shapes: dict, produce, meta: dict | None = None) -> str:
    """`save` of a model-only checkpoint whose arrays (fp32) are produced one at a time,
    `produce(name)` in the order of `shapes` ({name: shape}): the safetensors header is known from
    the shapes, so each array is written as soon as it is made (peak memory: one array). Files of
    that iteration already saved in another format stay beside it (scan.carry_over)."""
    staged = _new_iteration_dir(root, iteration)
    entries, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * int(np.prod(shape, dtype=np.int64))
        entries[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)          # safetensors aligns the data to 8 bytes

    def write(path):
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for name, shape in shapes.items():
                array = np.ascontiguousarray(produce(name), dtype=np.float32)
                if array.shape != tuple(shape):
                    raise ValueError(f"{name}: produced shape {array.shape}, expected {tuple(shape)}")
                f.write(array.data)

    write(os.path.join(staged, MODEL_FILE))
    scan.carry_over(root, iteration)        # a copy beside the iteration's other files (the converter's)
    return _commit(root, staged, iteration, meta)


def _dump_json(obj, path):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)


_HEADER_LIMIT = 100 * 2**20      # safetensors' own cap on the JSON header
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
             "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


def check_safetensors(path: str) -> str | None:
    """None when `path` is a whole safetensors file (header parsed, every tensor's bytes inside
    the file, the file exactly as long as the header says); else the problem, naming the file.
    Reads the header only."""
    if not os.path.isfile(path):
        return f"{path} is missing"
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                return f"{path} is truncated ({size} bytes: not even a safetensors header)"
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _HEADER_LIMIT:
                return f"{path} is not a safetensors file (header length {header_len})"
            if 8 + header_len > size:
                return f"{path} is truncated ({size} bytes, its header alone needs {8 + header_len})"
            header = json.loads(f.read(header_len).decode("utf-8"))
    except OSError as err:
        return f"{path} is unreadable ({err.strerror or err})"
    except (UnicodeDecodeError, ValueError) as err:
        return f"{path} has a damaged safetensors header ({type(err).__name__})"
    if not isinstance(header, dict):
        return f"{path} has a damaged safetensors header (not a JSON object)"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(v) for v in entry["data_offsets"])
            count = int(np.prod([int(d) for d in entry["shape"]], dtype=np.int64))
            itemsize = _ITEMSIZE[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            return f"{path} has a damaged safetensors header (entry {name!r})"
        if not 0 <= begin <= stop or stop - begin != count * itemsize:
            return f"{path} has a damaged safetensors header (entry {name!r})"
        end = max(end, stop)
    if size < 8 + header_len + end:
        return f"{path} is truncated ({size} bytes, its header needs {8 + header_len + end})"
    if size > 8 + header_len + end:
        return f"{path} has {size - 8 - header_len - end} bytes more than its header accounts for"
    return None


def is_torch_dist(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, ".metadata")) and not os.path.exists(os.path.join(directory, MODEL_FILE))


def check_iteration(directory: str) -> str | None:
    """None when the neutral checkpoint in `directory` can be read (model, optimizer when present,
    meta.json); else the problem, naming the file."""
    if not os.path.isdir(directory):
        return f"{directory} is missing"
    if is_torch_dist(directory):      # written by the torch trainer: loads through cross_format
        try:
            from mindspeed.checkpoint import torch_dist  # torch + Megatron-Core: may be absent (MindSpore trainer)
        except ImportError:
            return (f"{directory} holds a torch_dist checkpoint (written by --backend torch); reading it needs "
                    "torch and megatron-core installed")
        return torch_dist.check_iteration(directory)
    if scan.is_legacy(directory):     # Megatron-LM's per-rank files: torch_dist's load reads them, this one not
        return (f"{directory} holds Megatron-LM's legacy per-rank checkpoint (--ckpt-format torch), which the "
                "MindSpore trainer does not read: resume it once with --backend torch --ckpt-format torch_dist "
                "--save DIR (at the sizes it was saved at) and load DIR")
    problem = check_safetensors(os.path.join(directory, MODEL_FILE))
    if problem:
        return problem
    opt_path = os.path.join(directory, OPTIMIZER_FILE)
    if os.path.exists(opt_path):
        problem = check_safetensors(opt_path)
        if problem:
            return problem
    meta_path = os.path.join(directory, META_FILE)
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        return f"{meta_path} is missing"
    except (OSError, ValueError) as err:
        return f"{meta_path} is unreadable ({type(err).__name__})"
    if not isinstance(meta, dict) or not str(meta.get("iteration", "")).isdigit():
        return f"{meta_path} holds no iteration number"
    return None


def last_readable(root: str, exclude: int | None = None) -> int | None:
    """The newest iteration under root (other than `exclude`) whose files pass check_iteration."""
    return scan.last_readable(root, check_iteration, exclude)


def _split(path: str) -> tuple[str, int | None]:
    """(checkpoint root, iteration) of an iteration directory; (path, None) for a root."""
    path = os.path.normpath(path)
    m = ITERATION_DIR.match(os.path.basename(path))
    if m and not os.path.isfile(os.path.join(path, TRACKER_FILE)):
        return os.path.dirname(path), int(m.group(1))
    return path, None


def resolve(path: str, step: int | None = None) -> str:
    """The iteration directory to load: `path` itself when it is one, iteration `step` of the
    checkpoint root `path` when given, else the root's tracked iteration. Raises a one-line
    CheckpointError naming the last readable iteration when that directory cannot be read."""
    if not os.path.isdir(path):
        raise CheckpointError(f"--load path {path!r} does not exist or is not a directory")
    root, own = _split(path)
    if own is not None or os.path.isfile(os.path.join(path, MODEL_FILE)):
        if step is not None and own is not None and step != own:
            raise CheckpointError(f"--ckpt-step {step} does not match --load {path} (iteration {own}); "
                                  f"pass the checkpoint root: --load {root} --ckpt-step {step}")
        directory, iteration = path, own      # own is None: a directory not named iter_NNNNNNN
    elif step is not None:
        directory, iteration = iteration_dir(root, step), step
        if not os.path.isdir(directory):
            raise CheckpointError(f"--ckpt-step {step}: {directory} does not exist; "
                                  f"{resume_hint(root, last_readable(root))}")
    else:
        tracker = os.path.join(root, TRACKER_FILE)
        if not os.path.isfile(tracker):
            raise CheckpointError(f"--load path {path!r} holds no MindSpeed neutral checkpoint "
                                  f"(no {MODEL_FILE} and no {TRACKER_FILE})")
        with open(tracker, encoding="utf-8", errors="replace") as f:
            text = f.read().strip()
        if not text.isdigit():
            raise CheckpointError(f"{tracker} should hold an iteration number, found {text[:40]!r}; "
                                  f"{resume_hint(root, last_readable(root))}")
        iteration = int(text)
        directory = iteration_dir(root, iteration)
        if not os.path.isdir(directory):
            raise CheckpointError(f"{tracker} names iteration {iteration} but {directory} is missing; "
                                  f"{resume_hint(root, last_readable(root, exclude=iteration))}")
    problem = check_iteration(directory)
    if problem:
        if iteration is None:
            raise CheckpointError(f"checkpoint {directory} cannot be read: {problem}")
        raise unreadable(root, iteration, problem, last_readable(root, exclude=iteration))
    return directory


def read_meta(directory: str) -> dict:
    """An iteration directory's meta.json (already checked readable: check_iteration)."""
    with open(os.path.join(directory, META_FILE), encoding="utf-8") as f:
        return json.load(f)


def load(path: str, step: int | None = None) -> tuple[dict, dict | None, dict]:
    """(model arrays, optimizer arrays or None, meta) from a root or iteration directory (see
    resolve). A file that fails to decode is reported as a one-line CheckpointError."""
    directory = resolve(path, step)
    root, iteration = _split(directory)
    try:
        model = load_file(os.path.join(directory, MODEL_FILE))
        opt_path = os.path.join(directory, OPTIMIZER_FILE)
        optimizer = load_file(opt_path) if os.path.isfile(opt_path) else None
        with open(os.path.join(directory, META_FILE), encoding="utf-8") as f:
            meta = json.load(f)
    except Exception as err:   # SafetensorError and friends: damage the header check cannot see
        problem = f"{directory}: {type(err).__name__}: {err}"
        if iteration is None:
            raise CheckpointError(f"checkpoint {directory} cannot be read: {problem}") from None
        raise unreadable(root, iteration, problem, last_readable(root, exclude=iteration)) from None
    return model, optimizer, meta


def megatron_state_dict_arrays(path: str, tp_rank: int = 0, tp_size: int = 1, gated: bool = True) -> dict:
    """The arrays a Megatron-Core GPTModel on TP rank `tp_rank` of `tp_size` holds, by state-dict
    name, from a neutral checkpoint (gated=False: a GELU MLP's fc1). Torch side:
    `model.load_state_dict({k: torch.from_numpy(v) for k, v in arrays.items()}, strict=False)`
    (strict=False for Megatron's _extra_state entries)."""
    model, _, _ = load(path)
    return {name: shard_for_rank(name, full, tp_rank, tp_size, gated) for name, full in model.items()}


def full_arrays_from_shards(shards_by_rank: list[dict], gated: bool = True) -> dict:
    """Whole tensors from per-TP-rank state dicts of numpy arrays (Megatron names)."""
    names = shards_by_rank[0].keys()
    return {name: unshard(name, [s[name] for s in shards_by_rank], gated) for name in names}
