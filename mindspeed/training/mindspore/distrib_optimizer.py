"""--use-distributed-optimizer on the MindSpore trainer: ZeRO-1 over the data-parallel group.

Layout (Megatron's): all of this rank's parameters (its TP shards) in one flat fp32 buffer,
zero-padded to a multiple of DP and cut into DP equal slices; DP rank r owns slice r and keeps
the optimizer's state (Adam's moments, SGD's momentum) for it only. A flat buffer (not whole
parameters per rank) is what Megatron does: every rank holds the same number of state values
whatever the parameter sizes. The decayed
parameters come first and the others (1-D, biases) after, so a slice is at most two runs, one
per weight-decay value. The update is the trainer's own optimizer (optimizer.build_optimizer:
MindSpore's AdamW, or SGD) over those runs as two flat Parameters, the decayed one shaped [1, n] and
the other [n], so that Megatron's group rule (decay on matrices, not on 1-D weights) sorts them.

One step: the gradients are flattened and reduce-scattered over DP (the DP mean of this slice),
clipped by the global norm (each element counted once: slices are disjoint over DP, a
TP-replicated parameter counts on TP rank 0 only, and pipeline stages add up, as in
optimizer.clip_gradients), updated, and the updated slices all-gathered over DP into the model's
parameters.

The model's fp32 parameters (with --fp16 its fp32 masters, mixed_precision.MasterWeights: the
trainer rounds the fp16 weights from them after the update) are what it updates: the slice
Parameters are the optimizer's view of this rank's part, copied from them before each update, so a
load into the model between steps (checkpoint.load, load_full) is seen. So with --fp16 each rank
keeps the whole fp32 master copy (Megatron shards it with the optimizer state). With --reuse-fp32-param the masters are
folded into the bf16 weights and their residuals (reuse_fp32_param.FoldedWeights: read joined, written
split): the slices are the only fp32 copies.

Expert parallelism (EP > 1, or --moe-tp-extend-ep): the experts are a second flat buffer (a
_ShardedPart, same layout rules) sharded over the expert-data-parallel group (Megatron-Core's
expt_dp: the ranks holding the same experts), their gradients summed there and divided by the DP
size (Megatron's DDP); the dense parameters are the first buffer, over DP as above. The norm adds
the experts' squares over expert-DP, then over EP (each expert on one rank of the EP group).

Checkpoints: state_arrays gathers the slices back into whole per-parameter state (the names the
plain optimizer uses), so a checkpoint written with the flag loads without it and the other way round.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

from mindspeed.checkpoint.neutral import is_expert
from mindspeed.training.mindspore.optimizer import (_clipped, _flatten, _tensor, build_optimizer, decays,
                                                    expert_sum_of_squares, sum_of_squares_over_ranks)


class FlatLayout:
    """Where each parameter sits in the flat buffer, and which runs of it DP rank `dp_rank` owns."""

    def __init__(self, shapes: dict, dp_size: int, dp_rank: int):
        decayed = [n for n, s in shapes.items() if decays(n, s)]
        self.order = decayed + [n for n in shapes if n not in set(decayed)]
        self.shapes = {n: tuple(shapes[n]) for n in self.order}
        self.sizes = [int(np.prod(self.shapes[n])) for n in self.order]
        self.total = sum(self.sizes)
        self.decayed_total = sum(int(np.prod(self.shapes[n])) for n in decayed)
        self.shard = -(-self.total // dp_size)             # ceil: the last slice may end in padding
        self.padded = self.shard * dp_size
        self.lo, self.hi = dp_rank * self.shard, (dp_rank + 1) * self.shard
        # (start, end, decayed) in buffer offsets: the owned slice's runs, padding left out
        runs = [(self.lo, min(self.hi, self.decayed_total), True),
                (max(self.lo, self.decayed_total), min(self.hi, self.total), False)]
        self.runs = [r for r in runs if r[1] > r[0]]
        if not self.runs:
            raise ValueError(f"{self.total} parameter values cannot give each of {dp_size} data-parallel "
                             "ranks a part: use fewer data-parallel ranks or drop --use-distributed-optimizer")

    def offsets(self) -> dict:
        out, at = {}, 0
        for n, size in zip(self.order, self.sizes):
            out[n] = (at, at + size)
            at += size
        return out


@ms.jit
def _masked_sum_of_squares(grad, counted):
    return ops.square((grad * counted).astype(ms.float64)).sum()


class _SliceModel:
    """What optimizer.build_optimizer needs of a model: named Parameters (this rank's runs)."""

    def __init__(self, params: dict):
        self.params = params


class _ShardedPart:
    """One flat buffer sharded over one group: the dense parameters over the data-parallel group,
    or (expert parallelism) the experts over the expert-data-parallel group. Its own optimizer over
    its runs; `counted(name)`: whether the parameter's owned values enter the global norm."""

    def __init__(self, model, names: list, size: int, rank: int, group, args, counted):
        self.model, self.group = model, group
        # where the updated values go: the model's fp32 Parameters, or (--reuse-fp32-param) split into halves
        self.write = getattr(model, "write", None) or (lambda n, value: ops.assign(model.params[n], value))
        self.layout = lay = FlatLayout({n: model.params[n].shape for n in names}, size, rank)
        self.shapes = {f"zero1.{'decayed' if d else 'kept'}": (1, e - s) if d else (e - s,) for s, e, d in lay.runs}
        self.inner = build_optimizer(_SliceModel({n: ms.Parameter(ms.Tensor(np.zeros(shape, np.float32)), name=n)
                                                  for n, shape in self.shapes.items()}), args)
        self.slices = list(self.inner.model.params.values())      # the runs' order
        for slice_name, (_, _, d) in zip(self.shapes, lay.runs):
            assert self.inner.decays(slice_name) == d, slice_name
        mask = np.zeros(lay.shard, np.float32)
        for n, (s, e) in lay.offsets().items():
            if counted(n):
                mask[max(s, lay.lo) - lay.lo:max(min(e, lay.hi) - lay.lo, 0)] = 1.0
        self.counted = ms.Tensor(mask)

    def reduce_scattered(self, comm, grads: dict, dp_size: int):
        """This rank's slice of the gradients summed over the part's group, divided by the DP size
        (Megatron's DDP: the dense DP mean; an expert's sum over expert-DP over DP)."""
        lay = self.layout
        flat = _flatten(ms.mutable(tuple(_tensor(grads[n]) for n in lay.order)))
        missing = lay.padded - lay.total
        flat = flat if not missing else ops.cat([flat, ops.zeros(missing, flat.dtype)])
        mine = comm.reduce_scatter(flat, 0, self.group)
        return mine / dp_size if dp_size > 1 else mine

    def update(self, mine, lr: float) -> None:
        """Copy the model's values into the slice Parameters, update them with the gradient slice."""
        lay = self.layout
        weights = _flatten(ms.mutable(tuple(self.model.params[n] for n in lay.order)))
        for p, (s, e, _) in zip(self.slices, lay.runs):
            ops.assign(p, weights[s:e].reshape(p.shape))
        self.inner.step({n: mine[s - lay.lo:e - lay.lo].reshape(shape)
                         for (n, shape), (s, e, _) in zip(self.shapes.items(), lay.runs)}, lr)

    def gathered(self, comm, runs_values):
        """Every rank's slice (its runs, then padding), joined: the whole flat buffer, unpadded."""
        parts = [v.reshape(-1) for v in runs_values]
        used = sum(int(v.shape[0]) for v in parts)
        if used < self.layout.shard:
            parts.append(ops.zeros(self.layout.shard - used, ms.float32))
        whole = comm.all_gather(ops.cat(parts), 0, self.group)
        return whole[:self.layout.total]

    def gather_into_model(self, comm) -> None:
        whole = self.gathered(comm, self.slices)
        for n, part in zip(self.layout.order, ops.split(whole, self.layout.sizes)):
            self.write(n, part.reshape(self.layout.shapes[n]))

    def state_arrays(self, comm) -> dict:
        held, out = self.inner.state_arrays(), {}
        for state in self.inner.STATE:
            whole = self.gathered(comm, [ms.Tensor(held[f"{state}/{n}"]) for n in self.shapes]).asnumpy()
            for n, (s, e) in self.layout.offsets().items():
                out[f"{state}/{n}"] = whole[s:e].reshape(self.layout.shapes[n])
        return out

    def sliced_state(self, shards: dict) -> dict:
        """Whole per-parameter state (this part's names among `shards`) -> this rank's slice runs."""
        lay, mine = self.layout, {}
        for state in sorted({key.split("/", 1)[0] for key in shards}):
            flat = np.concatenate([np.asarray(shards[f"{state}/{n}"], np.float32).reshape(-1) for n in lay.order])
            for (n, shape), (s, e, _) in zip(self.shapes.items(), lay.runs):
                mine[f"{state}/{n}"] = flat[s:e].reshape(shape)
        return mine


class DistributedOptimizer:
    """The plain optimizer's interface (step_count, state_arrays, load_state_arrays) plus
    step_on_local_grads, which also reduces and clips: the gradients arrive as this rank's own
    (SP/CP-reduced, not DP-reduced)."""

    def __init__(self, model, backend, ps, args):
        self.model, self.comm, self.ps = model, backend.comm, ps
        names = list(model.params)
        experts = [n for n in names if is_expert(n)] if ps.ep_size > 1 else []
        dense = [n for n in names if n not in set(experts)]
        self.dense = _ShardedPart(model, dense, ps.dp_size, ps.dp_rank, ps.dp_group, args,
                                  model.counted_in_grad_norm)
        # each expert is whole on one rank of the EP group: every value counts in the norm
        self.experts = _ShardedPart(model, experts, ps.edp_size, ps.edp_rank, ps.edp_group, args,
                                    lambda _n: True) if experts else None
        self.parts = [p for p in (self.dense, self.experts) if p is not None]

    @property
    def step_count(self) -> int:
        return self.dense.inner.step_count

    def state_elements(self, part: str | None = None) -> int:
        """Optimizer state values this rank holds (part "dense" or "experts": that part's only)."""
        parts = self.parts if part is None else [p for p in (getattr(self, part),) if p is not None]
        return sum(int(a.size) for p in parts for a in p.inner.state_arrays().values())

    def step_on_local_grads(self, grads: dict, lr: float, max_norm: float):
        """Reduce-scatter, clip, update this rank's slices, all-gather the weights -> the global norm
        before clipping (0-d fp64 tensor)."""
        ps = self.ps
        mine = [p.reduce_scattered(self.comm, grads, ps.dp_size) for p in self.parts]
        sq = sum_of_squares_over_ranks(self.comm, ps, _masked_sum_of_squares(mine[0], self.dense.counted),
                                       over_dp=True)
        if self.experts is not None:     # the slices over expert-DP, then the other experts over EP
            sq = sq + expert_sum_of_squares(self.comm, ps, _masked_sum_of_squares(mine[1], self.experts.counted),
                                            over_edp=True)
        if max_norm and max_norm > 0:
            mine = list(_clipped(ms.mutable(tuple(mine)), sq, ms.Tensor(max_norm, ms.float64)))
        for part, slice_grads in zip(self.parts, mine):
            part.update(slice_grads, lr)
        for part in self.parts:
            part.gather_into_model(self.comm)
        return ops.sqrt(sq)

    def state_arrays(self) -> dict:
        """Whole per-parameter state, as the plain optimizer names it (every rank must call it:
        all-gathers over DP, and over expert-DP)."""
        return {k: v for part in self.parts for k, v in part.state_arrays(self.comm).items()}

    def load_state_arrays(self, shards: dict, step_count: int) -> None:
        """shards: whole (TP-local) state by name, as the plain optimizer takes it; this rank keeps
        its slices (the plain optimizer's load checks which state it is)."""
        for part in self.parts:
            part.inner.load_state_arrays(part.sliced_state(shards), step_count)
