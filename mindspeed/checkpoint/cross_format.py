"""Resuming on one framework from the other's checkpoint.

The torch trainer saves torch_dist (Megatron-Core's dist_checkpointing), the MindSpore trainer the
framework-neutral safetensors (neutral_format). Both hold the same things under the same Megatron
names: the weights, the optimizer's state per parameter (Adam's two moments, or SGD's momentum
buffer), its step count, the iteration and the samples consumed; one optimizer's state offered to
the other is refused in one line (--no-load-optim loads the weights only). This module maps one onto the other, so `--load` takes either:

- torch trainer, neutral checkpoint (`fill_from_neutral`): the trainer's own sharded state dict
  (model + optimizer, at its TP/PP) is filled from the whole neutral arrays, the way
  dist_checkpointing.load fills it from torch_dist files; the learning-rate schedule is rebuilt
  from the samples consumed.
- MindSpore trainer, torch_dist checkpoint (`neutral_from_torch_dist`): the torch_dist tensors are
  read whole, without a process group (convert.megatron_read), and renamed to the neutral names.
  Needs torch installed next to MindSpore.

Megatron's distributed optimizer stores its moments flattened per data-parallel shard, not per
parameter: those moments do not cross (one line says to add --no-load-optim; the weights still load).
The vocabulary padding differs with the TP size (Megatron pads to a multiple of 128 x TP): only
padding rows are added or dropped.
"""
from __future__ import annotations

import numpy as np

from mindspeed.errors import CheckpointError
from mindspeed.checkpoint import neutral as nf

MOMENTS = ("exp_avg", "exp_avg_sq")
STATES = MOMENTS + ("momentum_buffer",)      # Adam's two moments, SGD's momentum (torch's names)
OPT_PREFIX = "optimizer.state."
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


# MoE layers in torch_dist (the local spec's SequentialMLP): the router and the shared experts
# stacked by layer like the dense weights; each expert weight stacked by layer, then by global expert
MOE_LAYER_SUFFIXES = ("mlp.router.weight", "mlp.shared_experts.linear_fc1.weight",
                      "mlp.shared_experts.linear_fc2.weight")
EXPERT_KEYS = {"linear_fc1.weight": "decoder.layers.mlp.experts.experts.linear_fc1.weight",
               "linear_fc2.weight": "decoder.layers.mlp.experts.experts.linear_fc2.weight"}


def _layer_keys() -> dict:
    from mindspeed.checkpoint.megatron_read import LAYER_KEYS, STACKED  # imports torch; read by the MindSpore trainer
    return {**LAYER_KEYS, **{suffix: STACKED + suffix for suffix in MOE_LAYER_SUFFIXES}}


def fit_vocab_rows(name: str, array: np.ndarray, rows: int) -> np.ndarray:
    """`array` with `rows` rows for the vocabulary tensors: zero padding rows added or dropped.
    `rows` is this model's padded vocabulary, never below the real one, so only padding rows are
    dropped."""
    if not name.endswith(VOCAB_ROWS) or array.shape[0] == rows:
        return array
    if array.shape[0] > rows:
        return array[:rows]
    return np.concatenate([array, np.zeros((rows - array.shape[0], *array.shape[1:]), array.dtype)])


# --- neutral -> torch trainer -------------------------------------------------------------------
class _NeutralSource:
    """Whole arrays by torch_dist key (decoder layers stacked on a leading axis, as torch_dist keeps them)."""

    def __init__(self, model: dict, moments: dict | None, directory: str):
        self.model, self.moments, self.dir = model, moments or {}, directory
        self.num_layers = 1 + max((int(k.split(".")[2]) for k in model if k.startswith("decoder.layers.")),
                                  default=-1)
        self.stacked_suffix = {key: suffix for suffix, key in _layer_keys().items()}
        self.expert_suffix = {key: suffix for suffix, key in EXPERT_KEYS.items()}
        self.num_experts = len({nf.expert_of(k) for k in model if nf.is_expert(k)})
        self._cache: dict = {}

    def array(self, key: str) -> np.ndarray:
        if key not in self._cache:
            self._cache[key] = self._build(key)
        return self._cache[key]

    def _build(self, key: str) -> np.ndarray:
        table, name = self.model, key
        if key.startswith(OPT_PREFIX):
            moment, _, name = key[len(OPT_PREFIX):].partition(".")
            if moment not in STATES:
                raise self._refuse(key)
            if not self.moments:
                raise CheckpointError(f"checkpoint {self.dir} holds no optimizer state: load it with --no-load-optim")
            if not any(k.startswith(moment + "/") for k in self.moments):
                held = ", ".join(sorted({k.split("/", 1)[0] for k in self.moments}))
                raise CheckpointError(f"checkpoint {self.dir} holds another optimizer's state ({held}), not this "
                                      f"--optimizer's {moment}: add --no-load-optim to load the weights only")
            table = {k.split("/", 1)[1]: v for k, v in self.moments.items() if k.startswith(moment + "/")}
        if name in self.expert_suffix:      # [layer, expert, ...]
            suffix = self.expert_suffix[name]
            names = [[nf.expert_name(i, e, suffix) for e in range(self.num_experts)] for i in range(self.num_layers)]
            missing = [n for row in names for n in row if n not in table]
            if missing or not self.num_experts:
                held = missing[0] if missing else nf.expert_name(0, 0, suffix)
                raise CheckpointError(f"checkpoint {self.dir} does not fit this model: it holds no {held}")
            return np.stack([np.stack([table[n] for n in row]) for row in names])
        if name in self.stacked_suffix:
            suffix = self.stacked_suffix[name]
            names = [nf.layer_name(i, suffix) for i in range(self.num_layers)]
            missing = [n for n in names if n not in table]
            if missing:
                raise CheckpointError(f"checkpoint {self.dir} does not fit this model: it holds no {missing[0]}")
            return np.stack([table[n] for n in names])
        if name not in table:
            raise CheckpointError(f"checkpoint {self.dir} does not fit this model: it holds no {name}")
        return table[name]

    def _refuse(self, key: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {self.dir} was written by the MindSpore trainer; its optimizer state does not map onto "
            f"this optimizer's {key!r} (Megatron's distributed optimizer keeps flattened shards): add "
            "--no-load-optim to load the weights only, or drop --use-distributed-optimizer")

    def fill(self, sh):
        """Copy this rank's part of the whole array into the ShardedTensor's tensor; return the tensor."""
        import torch  # noqa: F401  (installed? the readers below import it)
        if getattr(sh, "flattened_range", None) is not None:
            raise self._refuse(sh.key)
        full = self.array(sh.key)
        pre = sh.prepend_axis_num
        name = sh.key[len(OPT_PREFIX):].partition(".")[2] if sh.key.startswith(OPT_PREFIX) else sh.key
        full = fit_vocab_rows(name, full, sh.global_shape[pre])
        if tuple(full.shape) != tuple(sh.global_shape):
            raise CheckpointError(f"checkpoint {self.dir} does not fit this model: {sh.key} is "
                                  f"{tuple(full.shape)}, this model's {tuple(sh.global_shape)}")
        index = tuple(sh.global_offset[:pre]) + tuple(
            slice(o, o + n) for o, n in zip(sh.global_offset[pre:], sh.local_shape))
        sh.data.copy_(torch.from_numpy(np.ascontiguousarray(full[index])).to(sh.data.dtype))
        return sh.data


def fill_from_neutral(state: dict, directory: str) -> dict:
    """What dist_checkpointing.load(state, torch_dist_dir) returns, from the neutral checkpoint in
    `directory` instead: every ShardedTensor of the trainer's sharded state dict replaced by its
    tensor filled from the neutral arrays; iteration, samples and Adam's step from meta.json."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    model, moments, meta = nf.load(directory)
    source = _NeutralSource(model, moments if "optimizer" in state else None, directory)
    sharded, nonpersistent, factories = load_preprocess(state)
    sharded, common = extract_sharded_base(sharded)
    merge(common, nonpersistent)

    def fill(value):
        if isinstance(value, ShardedTensor):
            return source.fill(value)
        if isinstance(value, ShardedBase) and value.key.split("/")[0].endswith("._extra_state"):
            return None                           # Transformer Engine's slot; the local layers keep nothing there
        if isinstance(value, ShardedBase):        # other ShardedObjects: the distributed optimizer's layout
            raise source._refuse(value.key)
        return value

    with torch.no_grad():                          # copies into parameters and optimizer state
        merge(common, dict_list_map_inplace(fill, sharded))
    loaded = apply_factory_merges(common, factories)
    loaded["iteration"] = int(meta["iteration"])
    loaded["consumed_train_samples"] = int(meta.get("consumed_samples", 0))
    optimizer = loaded.get("optimizer")
    if isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict):
        # Megatron keeps Adam's step once for all parameters (torch_dist: common.pt)
        optimizer["state"]["common_step"] = torch.tensor(float(meta.get("optimizer_steps", meta["iteration"])))
    return loaded


# --- torch_dist -> MindSpore trainer ------------------------------------------------------------
def neutral_from_torch_dist(directory: str, load_optimizer: bool) -> tuple[dict, dict | None, dict]:
    """(model arrays, optimizer arrays or None, meta) under the neutral names, from a torch_dist
    iteration directory (already checked readable)."""
    try:
        import torch  # noqa: F401  (installed? the readers below import it)
    except ImportError:
        raise CheckpointError(f"checkpoint {directory} was written by the torch trainer; reading it needs torch "
                              "(pip install torch), or convert it where torch is installed") from None
    from mindspeed.checkpoint import common_state, megatron_read  # import torch, Megatron-Core (checked above)
    reader = megatron_read.TorchDistReader(directory)
    try:
        common = common_state.load_common(f"{directory}/common.pt")
    except common_state.UnsafeCommonState as err:
        raise CheckpointError(str(err)) from None

    def read(prefix: str) -> dict:
        out = {}
        for suffix, key in _layer_keys().items():
            if reader.has(prefix + key):
                stacked = reader.get(prefix + key).float().numpy()
                out.update({nf.layer_name(i, suffix): stacked[i] for i in range(stacked.shape[0])})
        for suffix, key in EXPERT_KEYS.items():
            if reader.has(prefix + key):
                stacked = reader.get(prefix + key).float().numpy()      # [layer, expert, ...]
                out.update({nf.expert_name(i, e, suffix): stacked[i, e] for i in range(stacked.shape[0])
                            for e in range(stacked.shape[1])})
        for key in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"):
            if reader.has(prefix + key):
                out[key] = reader.get(prefix + key).float().numpy()
        return out

    model = read("")
    moments = None
    # a model-only checkpoint (as the converter writes) has no optimizer state to want: the
    # weights load, Adam starts fresh, as from a neutral checkpoint without optimizer.safetensors
    if load_optimizer and any(key.startswith("optimizer.") for key in reader.meta):
        moments = {f"{m}/{k}": v for m in STATES for k, v in read(f"{OPT_PREFIX}{m}.").items()}
        if not moments:
            raise CheckpointError(
                f"checkpoint {directory} was written by the torch trainer with Megatron's distributed optimizer "
                "(moments kept as flattened shards), which the MindSpore trainer cannot map: add --no-load-optim "
                "to load the weights only")
    step = common.get("optimizer", {}).get("state", {}).get("common_step", common["iteration"])
    meta = dict(iteration=int(common["iteration"]), consumed_samples=int(common.get("consumed_train_samples", 0)),
                optimizer_steps=int(step), backend="torch", no_optimizer=bool(common.get("no_optimizer")))
    return model, moments, meta
