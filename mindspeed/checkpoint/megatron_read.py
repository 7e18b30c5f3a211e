"""Reads the trainers' checkpoints one tensor (or one decoder layer) at a time, without a process
group, under the model's own parameter names:

- the torch trainer's torch_dist (at any TP/PP): torch.distributed.checkpoint keeps, per tensor, its
  global shape and the chunks each saving rank wrote (offset, size), each chunk a torch.save blob at
  a byte range of a .distcp file. Reading a tensor -- or one layer of a layer-stacked tensor -- is
  reading the chunks that overlap it and placing them at their offsets, which undoes the TP split
  and the PP split at once.
- the MindSpore trainer's framework-neutral safetensors (whole tensors under the model's names),
  memory-mapped.
- Megatron-LM's legacy per-rank files (--ckpt-format torch): legacy_read.LegacyReader.

Peak memory: the largest tensor asked for (one layer's slice of the stacked ones).
"""
from __future__ import annotations

import io
import os

import torch

from mindspeed.errors import ConvertError
from mindspeed.checkpoint.neutral import MODEL_FILE, QK_NORMS
from mindspeed.checkpoint.scan import is_legacy, iteration_dir
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
    # --qk-layernorm: the per-head q/k norms (one [head_dim] weight per layer; LayerNorm's bias too)
    **{f"self_attention.{norm}.{part}": f"{STACKED}self_attention.{norm}.{part}"
       for norm in QK_NORMS for part in ("weight", "bias")},
}
LAYER_SUFFIXES = tuple(LAYER_KEYS)

# Where a layer's tensors sit in torch_dist: stacked over the layers as above ("decoder.layers.<suffix>",
# the layer a prepended axis), or -- where the layers differ, as dense and MoE layers do -- one key per
# layer ("decoder.layers.<i>.<suffix>", i the global layer). Either way each MoE expert's weight is one
# key with the global expert as a further prepended axis: model-local `mlp.experts.local_experts.<e>.X`
# is torch_dist's `mlp.experts.experts.X` at expert e. (Multi-latent attention's spec keeps the norms'
# own names.)
NORM_KEYS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
NORM_SUFFIXES = {key: suffix for suffix, key in NORM_KEYS.items()}
LOCAL_EXPERTS, EXPERT_KEYS = "mlp.experts.local_experts.", "mlp.experts.experts."


MTP = "mtp.layers."             # Megatron-Core's multi-token-prediction layers: one key each, never stacked
MTP_LAYER = "transformer_layer."   # an MTP layer's decoder layer


def key_suffix(suffix: str) -> tuple[str, int | None]:
    """A layer's model-local suffix -> (its torch_dist suffix, the global expert or None)."""
    head = MTP_LAYER if suffix.startswith(MTP_LAYER) else ""
    suffix = suffix[len(head):]
    if suffix.startswith(LOCAL_EXPERTS):
        expert, rest = suffix[len(LOCAL_EXPERTS):].split(".", 1)
        return head + EXPERT_KEYS + rest, int(expert)
    return head + NORM_KEYS.get(suffix, suffix), None


def model_suffix(key_part: str, expert: int | None) -> str:
    """The inverse of key_suffix."""
    head = MTP_LAYER if key_part.startswith(MTP_LAYER) else ""
    key_part = key_part[len(head):]
    if key_part.startswith(EXPERT_KEYS):
        return f"{head}{LOCAL_EXPERTS}{expert}.{key_part[len(EXPERT_KEYS):]}"
    return head + NORM_SUFFIXES.get(key_part, key_part)


def split_layer_key(key: str) -> tuple[int | None, str]:
    """(the layer, the suffix) of a per-layer torch_dist key "decoder.layers.<i>.<suffix>"; (None, the
    suffix) of a stacked one "decoder.layers.<suffix>"."""
    rest = key[len(STACKED):]
    head, _, tail = rest.partition(".")
    return (int(head), tail) if head.isdigit() else (None, rest)


def _expert_axis(part: str) -> bool:
    return part.startswith(EXPERT_KEYS) or part.startswith(MTP_LAYER + EXPERT_KEYS)


def model_name(key: str, prepended: tuple[int, ...]) -> str:
    """The model-local parameter name of the torch_dist chunk `key` whose prepended axes sit at the
    offsets `prepended` (layer and/or expert)."""
    if key.startswith(MTP):
        j, _, part = key[len(MTP):].partition(".")
        return f"{MTP}{j}.{model_suffix(part, prepended[0] if _expert_axis(part) else None)}"
    if not key.startswith(STACKED):
        return key
    layer, part = split_layer_key(key)
    if layer is None:
        layer, prepended = prepended[0], prepended[1:]
    expert = prepended[0] if _expert_axis(part) else None
    return f"decoder.layers.{layer}.{model_suffix(part, expert)}"


def block_prefix(layer) -> str:
    """The model-local prefix of a block: decoder layer `layer` (an int), or the prefix itself (a str,
    e.g. "mtp.layers.0.")."""
    return f"{STACKED}{layer}." if isinstance(layer, int) else layer


def open_checkpoint(root: str):
    """The reader for the iteration the tracker names, checked as the trainers check it before a
    load: torch_dist when the directory holds one (it keeps the parameters' dtype), else the
    MindSpore trainer's neutral safetensors."""
    from mindspeed.checkpoint import torch_dist  # imports Megatron-Core: mg->hf conversion reads with torch alone
    try:
        directory = iteration_dir(root, torch_dist.read_tracker(root))   # checks either format
    except CheckpointError as err:
        raise ConvertError(str(err)) from None
    if is_legacy(directory):
        from mindspeed.checkpoint.legacy_read import LegacyReader  # imports this module
        return LegacyReader(directory)
    return NeutralReader(directory) if torch_dist.is_neutral(directory) else TorchDistReader(directory)


class TorchDistReader:
    def __init__(self, directory: str):
        from mindspeed.checkpoint.torch_dist import read_index  # imports Megatron-Core (see open_checkpoint)
        self.dir = directory
        index = read_index(directory)
        self.meta = index.state_dict_metadata
        self.pieces: dict[str, list] = {}   # key -> [(chunk offsets, chunk sizes, storage info)]
        for mindex, info in index.storage_data.items():
            if getattr(info, "transform_descriptors", None):
                raise ConvertError(f"{directory}: {mindex.fqn} is stored transformed "
                                   f"({info.transform_descriptors}); only plain torch_dist files are read")
            if mindex.offset is not None:
                sizes = {tuple(c.offsets): tuple(c.sizes) for c in self.meta[mindex.fqn].chunks}
                offsets = tuple(mindex.offset)
                self.pieces.setdefault(mindex.fqn, []).append((offsets, sizes[offsets], info))

    # model-local names ------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.pieces

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.pieces:
            raise ConvertError(f"checkpoint {self.dir} has no tensor {name!r}")
        return tuple(self.meta[name].size)

    def get(self, name: str) -> torch.Tensor:
        return self._assemble(name, ())

    def _where(self, suffix: str, layer) -> tuple[str, tuple[int, ...]] | None:
        """(torch_dist key, the indices of its prepended axes) of `suffix` in decoder layer `layer` (an int) or
        under the prefix `layer` (a str), None if absent."""
        part, expert = key_suffix(suffix)
        experts = () if expert is None else (expert,)
        # the norms under Transformer Engine's fused names, or their own (multi-latent attention's spec)
        for name in dict.fromkeys((part, suffix if expert is None else part)):
            candidates = [(block_prefix(layer) + name, experts)]
            if isinstance(layer, int):
                candidates.append((STACKED + name, (layer, *experts)))
            for key, index in candidates:
                if key in self.pieces and all(i < n for i, n in zip(index, self.meta[key].size)):
                    return key, index
        return None

    def has_layer(self, suffix: str, layer: int | None = None) -> bool:
        """Layer `layer` (any decoder layer with None) has the tensor `suffix`."""
        layers = range(self.num_layers()) if layer is None else (layer,)
        return any(self._where(suffix, i) is not None for i in layers)

    def num_layers(self) -> int:
        count = 0
        for key in self.pieces:
            if key.startswith(STACKED):
                layer, _ = split_layer_key(key)
                count = max(count, layer + 1 if layer is not None else self.meta[key].size[0])
        return count

    def mtp_layers(self) -> int:
        return len({key[len(MTP):].split(".", 1)[0] for key in self.pieces if key.startswith(MTP)})

    def layer_suffixes(self, layer) -> set[str]:
        """The model-local suffixes of every tensor of decoder layer `layer` (an int), or under the
        prefix `layer` (a str: an MTP layer's)."""
        found = set()
        prefix = block_prefix(layer)
        for key in self.pieces:
            size = tuple(self.meta[key].size)
            if key.startswith(prefix):
                part = key[len(prefix):]
            elif isinstance(layer, int) and key.startswith(STACKED) and split_layer_key(key)[0] is None:
                part, size = key[len(STACKED):], size[1:]
                if layer >= self.meta[key].size[0]:
                    continue
            else:
                continue
            experts = range(size[0]) if _expert_axis(part) else (None,)
            found.update(model_suffix(part, e) for e in experts)
        return found

    def layer_shape(self, suffix: str, layer=0) -> tuple[int, ...]:
        where = self._where(suffix, layer)
        if where is None:
            raise ConvertError(f"checkpoint {self.dir} has no {block_prefix(layer)}{suffix}")
        key, index = where
        return self.shape(key)[len(index):]

    def get_layer(self, suffix: str, layer) -> torch.Tensor:
        where = self._where(suffix, layer)
        if where is None:
            raise ConvertError(f"checkpoint {self.dir} has no {block_prefix(layer)}{suffix}")
        return self._assemble(*where)

    def layer_tensor(self, key: str, layer: int) -> torch.Tensor:
        """Layer `layer` of the layer-stacked tensor `key` (a torch_dist key), or of its per-layer key."""
        if key not in self.pieces and key.startswith(STACKED):
            return self._assemble(f"{STACKED}{layer}.{key[len(STACKED):]}", ())
        return self._assemble(key, (layer,))

    # chunks -----------------------------------------------------------------------------------
    def _assemble(self, key: str, index: tuple[int, ...]) -> torch.Tensor:
        """The global tensor `key`, or its slice [index] along its first axes (layer-stacked keys: the
        layer; expert keys: the expert). A chunk may span several of those (GroupedMLP's: a rank's
        experts in one chunk)."""
        shape = self.shape(key)
        n = len(index)
        out = torch.empty(shape[n:], dtype=self.meta[key].properties.dtype)
        filled = 0
        for offsets, sizes, info in self.pieces[key]:
            if not all(o <= i < o + c for i, o, c in zip(index, offsets, sizes)):
                continue
            chunk = self._read(info)
            chunk, offsets = chunk[tuple(i - o for i, o in zip(index, offsets))], offsets[n:]
            out[tuple(slice(o, o + c) for o, c in zip(offsets, chunk.shape))] = chunk
            filled += chunk.numel()
        if filled != out.numel():   # chunks never overlap in torch_dist (replicas are written once)
            raise ConvertError(f"checkpoint {self.dir}: the chunks of {key!r}"
                               f"{'' if not index else f' at {list(index)}'} cover {filled} of "
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

    def has_layer(self, suffix: str, layer: int | None = None) -> bool:
        layers = range(self.num_layers()) if layer is None else (layer,)
        return any(self.has(f"decoder.layers.{i}.{suffix}") for i in layers)

    def num_layers(self) -> int:
        return 1 + max((int(n.split(".")[2]) for n in self._names if n.startswith(STACKED)), default=-1)

    def mtp_layers(self) -> int:
        return len({n[len(MTP):].split(".", 1)[0] for n in self._names if n.startswith(MTP)})

    def layer_suffixes(self, layer) -> set[str]:
        prefix = block_prefix(layer)
        return {n[len(prefix):] for n in self._names if n.startswith(prefix)}

    def layer_shape(self, suffix: str, layer=0) -> tuple[int, ...]:
        return self.shape(block_prefix(layer) + suffix)

    def get_layer(self, suffix: str, layer) -> torch.Tensor:
        return self.get(block_prefix(layer) + suffix)
