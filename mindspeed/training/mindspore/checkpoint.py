"""Save/load the MindSpore trainer's state as a neutral checkpoint (see neutral_format).

Tensor-parallel shards are gathered into whole tensors, expert-parallel ranks' experts and
pipeline stages' parameters onto rank 0, before rank 0 writes one whole model; each rank cuts out its stage and shard again on
load, so a checkpoint written at one TP or PP size loads at another, and on the torch side.
"""
from __future__ import annotations

import numpy as np
from mindspore import ops

from mindspeed.errors import CheckpointError
from mindspeed.checkpoint import cross_format
from mindspeed.checkpoint import neutral as nf


def _gather_tp(backend, ps, arrays: dict, gated: bool = True, experts_sharded: bool = False) -> dict:
    """Whole tensors from this TP group's shards (one collective for all of them); gated: the MLP's
    fc1 holds SwiGLU's [gate; up] halves. Experts are whole on their rank unless experts_sharded (expert
    TP = TP): with --moe-tp-extend-ep the TP ranks hold different experts, which pass through, for _gather_ep."""
    if ps.tp_size == 1:
        return dict(arrays)
    import mindspore as ms
    names = [n for n in arrays if experts_sharded or not nf.is_expert(n)]
    flat = ops.cat([ms.Tensor(arrays[n]).reshape(-1) for n in names]).expand_dims(0)
    every = backend.comm.all_gather(flat, 0, ps.tp_group).asnumpy()        # [tp, total]
    out, start = {}, 0
    for n in names:
        size = arrays[n].size
        out[n] = nf.unshard(n, [every[r, start:start + size].reshape(arrays[n].shape) for r in range(ps.tp_size)],
                           gated, experts_sharded)
        start += size
    return {**out, **{n: a for n, a in arrays.items() if n not in out}}


def _gather_pp(backend, ps, model, arrays: dict, prefixes=("",)) -> dict:
    """Every stage's whole tensors on every rank: stage p's go by a broadcast from it over the
    pipeline group. The names and shapes of each stage's tensors follow from the config, so the
    receivers know them without asking."""
    if getattr(ps, "pp_size", 1) == 1:
        return dict(arrays)
    keys_by_stage = []
    shared = type(model).shared_across_stages(model.cfg, ps.pp_size)
    for stage in range(ps.pp_size):
        shapes = type(model).stage_shapes(model.cfg, stage, ps.pp_size)
        # a weight two stages share goes from the first (the copies are equal)
        keys_by_stage.append([(pre + n, s) for pre in prefixes for n, s in shapes.items()
                              if stage == 0 or n not in shared])
    return _from_each_owner(backend, ps.pp_group, ps.pp_rank, arrays, keys_by_stage)


def _from_each_owner(backend, group, my_rank: int, arrays: dict, keys_by_owner: list) -> dict:
    """Tensors each held by one rank of `group`, on every rank: owner r's go by one broadcast from it
    (keys_by_owner[r]: their (name, shape), known to every rank from the config)."""
    import mindspore as ms
    out = {}
    for owner, keys in enumerate(keys_by_owner):
        if owner == my_rank:
            flat = ms.Tensor(np.concatenate([arrays[k].reshape(-1) for k, _ in keys]).astype(np.float32))
        else:
            flat = ops.zeros((sum(int(np.prod(s)) for _, s in keys),), ms.float32)
        flat = backend.comm.broadcast(flat, owner, group).asnumpy()
        start = 0
        for k, shape in keys:
            size = int(np.prod(shape))
            out[k] = flat[start:start + size].reshape(shape)
            start += size
    return out


def _gather_ep(backend, ps, model, arrays: dict, prefixes=("",)) -> dict:
    """Every expert on every rank: EP rank r's experts go by a broadcast from it over the EP group
    (their names and shapes follow from the config, as the pipeline stages' do)."""
    if getattr(ps, "ep_size", 1) == 1:
        return dict(arrays)
    owner = lambda name: nf.expert_owner(nf.expert_of(name), model.cfg.num_experts, ps.ep_size)
    experts = {n: s for n, s in model.cfg.full_shapes().items() if nf.is_expert(n)}
    keys_by_rank = [[(pre + n, s) for pre in prefixes for n, s in experts.items() if owner(n) == r]
                    for r in range(ps.ep_size)]
    return {**{k: v for k, v in arrays.items() if not nf.is_expert(k)},
            **_from_each_owner(backend, ps.ep_group, ps.ep_rank, arrays, keys_by_rank)}


def save(backend, ps, root: str, iteration: int, model, optimizer, meta: dict, with_optimizer: bool = True) -> None:
    """The whole model (and, unless with_optimizer is False, --no-save-optim, the optimizer's state) as
    one neutral checkpoint written by rank 0."""
    gated = model.cfg.swiglu
    # the fp32 weights: with --fp16 the masters (model.master_params), never the fp16 copies
    params = _gather_tp(backend, ps, {n: p.asnumpy() for n, p in model.master_params().items()}, gated,
                        model.cfg.experts_tp_sharded)
    params = _gather_pp(backend, ps, model, _gather_ep(backend, ps, model, params))
    if model.expert_bias is not None:      # the same on every rank (summed counts)
        params.update(model.expert_bias.arrays())
    moments = _gathered_state(backend, ps, model, optimizer) if with_optimizer else None
    meta = dict(meta, optimizer_steps=optimizer.step_count) if with_optimizer else dict(meta, no_optimizer=True)
    if backend.comm.rank() == 0:
        nf.save(root, iteration, params, moments, meta)
    backend.comm.barrier()


def _gathered_state(backend, ps, model, optimizer) -> dict:
    moments = _gather_tp(backend, ps, optimizer.state_arrays(), model.cfg.swiglu, model.cfg.experts_tp_sharded)
    # the state's kinds (Adam's two moments, SGD's momentum) are the same on every stage
    kinds = tuple(sorted({key.split("/", 1)[0] + "/" for key in moments}))
    return _gather_pp(backend, ps, model, _gather_ep(backend, ps, model, moments, kinds), kinds)


def _fit_vocab(model, arrays: dict | None) -> dict | None:
    """The saver padded the vocabulary for its TP size: add or drop padding rows for this one."""
    if arrays is None:
        return None
    shapes = model.cfg.full_shapes()
    out = {}
    for key, value in arrays.items():
        name = key.split("/", 1)[-1]
        rows = shapes[name][0] if name in shapes else value.shape[0]
        out[key] = cross_format.fit_vocab_rows(name, value, rows)
    return out


def load(path: str, model, optimizer=None, *, load_optimizer: bool = True, step: int | None = None) -> dict:
    """Load weights (and the optimizer moments when present and wanted) from the checkpoint root
    or iteration directory `path` (iteration `step` of a root when given); returns meta.

    Every rank reads and checks the files itself, with no collective on the way, so a checkpoint
    that cannot be read (neutral_format.check_iteration) stops every rank with the same one-line
    CheckpointError and no rank is left waiting for the others."""
    directory = nf.resolve(path, step)
    if nf.is_torch_dist(directory):      # the torch trainer's checkpoint, renamed to the neutral names
        full, moments, meta = cross_format.neutral_from_torch_dist(directory, optimizer is not None and load_optimizer)
    else:
        full, moments, meta = nf.load(directory)
    if optimizer is not None and load_optimizer and meta.get("no_optimizer"):
        raise CheckpointError(f"checkpoint {directory} holds no optimizer state (saved with --no-save-optim): "
                              "resume it with --no-load-optim (or --finetune)")
    # the vocabulary is padded for the saving TP size (either trainer, or the converter's target)
    full, moments = _fit_vocab(model, full), _fit_vocab(model, moments)
    try:
        model.load_full(full)
        if model.expert_bias is not None:
            model.expert_bias.load(full)
        if optimizer is not None and load_optimizer and moments is not None:
            ps = model.ps
            shards = {k: np.ascontiguousarray(nf.shard_for_rank(k, v, ps.tp_rank, ps.tp_size, model.cfg.swiglu,
                                                                   model.cfg.experts_tp_sharded))
                      for k, v in moments.items()}
            optimizer.load_state_arrays(shards, int(meta.get("optimizer_steps", meta["iteration"])))
    except (KeyError, ValueError) as err:      # same on every rank: the files are the same
        detail = str(err).removeprefix("checkpoint does not fit this model: ") if isinstance(err, ValueError) \
            else f"it holds no {err}"
        raise CheckpointError(f"checkpoint {nf.resolve(path, step)} does not fit this model: {detail}") from None
    return meta
