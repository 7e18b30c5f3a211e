"""Reads Megatron-LM's legacy per-rank checkpoint (--ckpt-format torch, legacy.py) as whole tensors under
the model's names, as megatron_read's readers give the other formats: each rank's model_optim_rng.pt is
opened memory-mapped, its layers renumbered past the earlier pipeline stages' and its experts past the
earlier expert-parallel ranks', GroupedMLP's fused expert weights (--moe-grouped-gemm) split into the
experts' own fc1/fc2, and a tensor's tensor-parallel parts joined when it is asked for (legacy_layout).

Peak memory: the tensor asked for (its parts are read from the mapped files)."""
from __future__ import annotations

import re

from mindspeed.checkpoint import legacy, legacy_layout, scan
from mindspeed.checkpoint.megatron_read import NeutralReader
from mindspeed.errors import ConvertError

LAYER = re.compile(r"(decoder\.layers\.)(\d+)\.(.*)$")
EXPERT = re.compile(r"(.*mlp\.experts\.local_experts\.)(\d+)\.(.*)$")


class LegacyReader(NeutralReader):
    def __init__(self, directory: str):
        problem = legacy.check_iteration(directory)
        if problem:
            raise ConvertError(f"legacy checkpoint {directory} is incomplete: {problem}")
        sizes = legacy.saved_sizes(directory)
        if sizes is None:
            raise ConvertError(f"legacy checkpoint {directory}: its files do not record the parallel sizes "
                               "they were saved at (args.tensor_model_parallel_size ...)")
        self.dir, (self.tp, pp, ep) = directory, sizes
        missing = sorted(set(legacy.expected_rank_dirs(*sizes)) - set(scan.legacy_rank_dirs(directory)))
        if missing:
            raise ConvertError(f"legacy checkpoint {directory} is incomplete: {directory}/{missing[0]} is missing "
                               f"(it was saved at TP {sizes[0]} x PP {sizes[1]} x EP {sizes[2]})")
        files = {}
        for name in scan.legacy_rank_dirs(directory):
            state = legacy.read_file(f"{directory}/{name}/{legacy.MODEL_FILE}", mmap=True)
            files[_rank_of(name, pp, ep)] = state
        first = next(iter(files.values()))
        models = {rank: state.get("model") for rank, state in files.items()}
        if any(not isinstance(m, dict) for m in models.values()):
            raise ConvertError(f"legacy checkpoint {directory} holds no single 'model' (virtual pipeline stages "
                               "do not convert): resume it once with --ckpt-format torch_dist --save DIR")
        saved_args = first.get("args")
        tied = not getattr(saved_args, "untie_embeddings_and_output_weights", False)
        local_experts = int(getattr(saved_args, "num_experts", None) or 0) // ep
        self.grouped = any(k.endswith(legacy_layout.GROUPED) for m in models.values() for k in m)
        self._parts: dict[str, dict[int, object]] = {}    # whole name -> {tp rank: its part (or a thunk)}
        offsets = _layer_offsets(models, pp)
        for (t, p, e), model in sorted(models.items()):
            for key, value in model.items():
                if key.endswith("_extra_state") or (p > 0 and tied and key == "output_layer.weight"):
                    continue     # the last stage's copy of a tied embedding
                for name, part in _global_parts(key, value, offsets[p], e, local_experts, model):
                    if e > 0 and EXPERT.match(name) is None:
                        continue     # the non-expert tensors, as every expert-parallel rank holds them
                    self._parts.setdefault(name, {})[t] = part
        self._names = set(self._parts)

    def _pieces(self, name: str) -> list:
        if name not in self._parts:
            raise ConvertError(f"checkpoint {self.dir} has no tensor {name!r}")
        parts = self._parts[name]
        if sorted(parts) != list(range(self.tp)):
            raise ConvertError(f"checkpoint {self.dir}: {name} is not in every tensor-parallel rank's file")
        return [parts[t] for t in range(self.tp)]

    def shape(self, name: str) -> tuple[int, ...]:
        return legacy_layout.tp_merged_shape(name, [tuple(_data(p).shape) for p in self._pieces(name)])

    def get(self, name: str):
        return legacy_layout.tp_merge(name, [_data(p) for p in self._pieces(name)]).clone()


def _data(part):
    return part() if callable(part) else part


def _rank_of(dir_name: str, pp: int, ep: int) -> tuple[int, int, int]:
    """(TP, PP, EP) rank of an mp_rank_TT[_PPP][_EEE] directory."""
    numbers = [int(g) for g in scan.LEGACY_RANK_DIR.match(dir_name).groups() if g is not None]
    t, rest = numbers[0], numbers[1:]
    p = rest.pop(0) if pp > 1 else 0
    return t, p, (rest.pop(0) if ep > 1 else 0)


def _layer_offsets(models: dict, pp: int) -> list[int]:
    """The global number of each pipeline stage's first decoder layer (the stages' layer counts added)."""
    counts = [0] * pp
    for (_t, p, _e), model in models.items():
        layers = [int(m.group(2)) for m in map(LAYER.match, model) if m]
        counts[p] = max(counts[p], 1 + max(layers, default=-1))
    return [sum(counts[:p]) for p in range(pp)]


def _global_parts(key: str, value, layer_offset: int, ep_rank: int, local_experts: int, model: dict):
    """(global name, this rank's part) for the rank file's entry `key`: layers and experts renumbered,
    GroupedMLP's weight1/weight2 as each expert's fc1/fc2 (that expert's slices, taken when asked for)."""
    m = LAYER.match(key)
    name = f"{m.group(1)}{int(m.group(2)) + layer_offset}.{m.group(3)}" if m else key
    first = ep_rank * local_experts
    if key.endswith(legacy_layout.GROUPED[1]):
        return []        # taken with weight1
    if key.endswith(legacy_layout.GROUPED[0]):
        weight2 = model[key[:-len("weight1")] + "weight2"]
        prefix = name[:-len("weight1")] + "local_experts."
        return [(f"{prefix}{first + k}.linear_fc{which + 1}.weight",
                 lambda k=k, which=which: legacy_layout.grouped_expert(value, weight2, local_experts, k)[which])
                for k in range(local_experts) for which in (0, 1)]
    e = EXPERT.match(name)
    if e is None:
        return [(name, value)]
    return [(f"{e.group(1)}{first + int(e.group(2))}.{e.group(3)}", value)]
