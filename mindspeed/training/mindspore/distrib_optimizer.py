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
keeps the whole fp32 master copy (Megatron shards it with the optimizer state).

Checkpoints: state_arrays gathers the slices back into whole per-parameter state (the names the
plain optimizer uses), so a checkpoint written with the flag loads without it and the other way round.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

from mindspeed.training.mindspore.optimizer import (_clipped, _flatten, _tensor, build_optimizer, decays,
                                                    sum_of_squares_over_ranks)


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


class DistributedOptimizer:
    """The plain optimizer's interface (step_count, state_arrays, load_state_arrays) plus
    step_on_local_grads, which also reduces and clips: the gradients arrive as this rank's own
    (SP/CP-reduced, not DP-reduced)."""

    def __init__(self, model, backend, ps, args):
        self.model, self.comm, self.ps = model, backend.comm, ps
        self.names = list(model.params)
        self.layout = lay = FlatLayout({n: model.params[n].shape for n in self.names}, ps.dp_size, ps.dp_rank)
        self._shapes = {f"zero1.{'decayed' if d else 'kept'}": (1, e - s) if d else (e - s,) for s, e, d in lay.runs}
        self._inner = build_optimizer(_SliceModel({n: ms.Parameter(ms.Tensor(np.zeros(shape, np.float32)), name=n)
                                                   for n, shape in self._shapes.items()}), args)
        self._slices = list(self._inner.model.params.values())      # the runs' order
        for slice_name, (_, _, d) in zip(self._shapes, lay.runs):
            assert self._inner.decays(slice_name) == d, slice_name
        # 1 where the owned value counts in the global norm: TP-sharded, or TP rank 0 (replicated)
        counted = np.zeros(lay.shard, np.float32)
        for n, (s, e) in lay.offsets().items():
            if model.counted_in_grad_norm(n):
                counted[max(s, lay.lo) - lay.lo:max(min(e, lay.hi) - lay.lo, 0)] = 1.0
        self._counted = ms.Tensor(counted)

    @property
    def step_count(self) -> int:
        return self._inner.step_count

    def state_elements(self) -> int:
        """Optimizer state values this rank holds."""
        return sum(int(a.size) for a in self._inner.state_arrays().values())

    def _flat_params(self):
        return _flatten(ms.mutable(tuple(self.model.params[n] for n in self.layout.order)))

    def _padded(self, flat):
        missing = self.layout.padded - self.layout.total
        return flat if not missing else ops.cat([flat, ops.zeros(missing, flat.dtype)])

    def step_on_local_grads(self, grads: dict, lr: float, max_norm: float):
        """Reduce-scatter, clip, update this rank's slice, all-gather the weights -> the global norm
        before clipping (0-d fp64 tensor)."""
        lay, ps = self.layout, self.ps
        flat = self._padded(_flatten(ms.mutable(tuple(_tensor(grads[n]) for n in lay.order))))
        mine = self.comm.reduce_scatter(flat, 0, ps.dp_group)
        if ps.dp_size > 1:
            mine = mine / ps.dp_size                # the DP mean, as reduce_gradients' "avg"
        sq = sum_of_squares_over_ranks(self.comm, ps, _masked_sum_of_squares(mine, self._counted), over_dp=True)
        if max_norm and max_norm > 0:
            (mine,) = _clipped(ms.mutable((mine,)), sq, ms.Tensor(max_norm, ms.float64))
        weights = self._flat_params()
        for p, (s, e, _) in zip(self._slices, lay.runs):
            ops.assign(p, weights[s:e].reshape(p.shape))
        self._inner.step({n: mine[s - lay.lo:e - lay.lo].reshape(shape)
                          for (n, shape), (s, e, _) in zip(self._shapes.items(), lay.runs)}, lr)
        self._gather_into_model()
        return ops.sqrt(sq)

    def _gathered(self, runs_values):
        """Every rank's slice (its runs, then padding), joined: the whole flat buffer, unpadded."""
        parts = [v.reshape(-1) for v in runs_values]
        used = sum(int(v.shape[0]) for v in parts)
        if used < self.layout.shard:
            parts.append(ops.zeros(self.layout.shard - used, ms.float32))
        whole = self.comm.all_gather(ops.cat(parts), 0, self.ps.dp_group)
        return whole[:self.layout.total]

    def _gather_into_model(self) -> None:
        whole = self._gathered(self._slices)
        for n, part in zip(self.layout.order, ops.split(whole, self.layout.sizes)):
            ops.assign(self.model.params[n], part.reshape(self.layout.shapes[n]))

    def state_arrays(self) -> dict:
        """Whole per-parameter state, as the plain optimizer names it (every DP rank must call it:
        an all-gather)."""
        held, out = self._inner.state_arrays(), {}
        for state in self._inner.STATE:
            whole = self._gathered([ms.Tensor(held[f"{state}/{n}"]) for n in self._shapes]).asnumpy()
            for n, (s, e) in self.layout.offsets().items():
                out[f"{state}/{n}"] = whole[s:e].reshape(self.layout.shapes[n])
        return out

    def load_state_arrays(self, shards: dict, step_count: int) -> None:
        """shards: whole (TP-local) state by name, as the plain optimizer takes it; this rank keeps
        its slice (the plain optimizer's load checks which state it is)."""
        lay, mine = self.layout, {}
        for state in sorted({key.split("/", 1)[0] for key in shards}):
            flat = np.concatenate([np.asarray(shards[f"{state}/{n}"], np.float32).reshape(-1) for n in lay.order])
            for (n, shape), (s, e, _) in zip(self._shapes.items(), lay.runs):
                mine[f"{state}/{n}"] = flat[s:e].reshape(shape)
        self._inner.load_state_arrays(mine, step_count)
