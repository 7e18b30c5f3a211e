"""--use-distributed-optimizer on the MindSpore trainer: ZeRO-1 over the data-parallel group.

Layout (Megatron's): all of this rank's parameters (its TP shards) in one flat fp32 buffer,
zero-padded to a multiple of DP and cut into DP equal slices; DP rank r owns slice r and keeps
AdamW's moments for it only. A flat buffer (not whole parameters per rank) is what Megatron does:
every rank holds the same number of moment values whatever the parameter sizes. The decayed
parameters come first and the others (1-D, biases) after, so a slice is at most two runs, one
per weight-decay value: each run is one flat Parameter in its own AdamW group.

One step: the gradients are flattened and reduce-scattered over DP (the DP mean of this slice),
clipped by the global norm (each element counted once: slices are disjoint over DP, and a
TP-replicated parameter counts on TP rank 0 only, as in optimizer.clip_gradients), updated by
MindSpore's own AdamW, and the updated slices all-gathered over DP into the model's parameters.

The model's fp32 parameters stay the weights (this trainer has no bf16 master copy): the slice
Parameters are AdamW's view of this rank's part, copied from the model before each update, so a
load into the model between steps (checkpoint.load, load_full) is seen.

Checkpoints: state_arrays gathers the slices back into whole per-parameter moments (the names
Adam uses), so a checkpoint written with the flag loads without it and the other way round.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops
from mindspore.experimental.optim import AdamW

from mindspeed.training.mindspore.optimizer import (_clipped, _flatten, _fp64_sum_over,
                                                    _quiet_constant_tuple_warning, _tensor)


def decays(name: str, shape) -> bool:
    """Megatron-Core's default param groups (as optimizer.Adam): no decay on 1-D params and biases."""
    return len(shape) > 1 and not name.endswith(".bias")


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


class DistributedAdam:
    """Adam's interface (step_count, state_arrays, load_state_arrays) plus step_on_local_grads,
    which also reduces and clips: the gradients arrive as this rank's own (not yet DP-reduced)."""

    def __init__(self, model, backend, ps, *, beta1: float, beta2: float, eps: float, weight_decay: float):
        self.model, self.comm, self.ps = model, backend.comm, ps
        self.names = list(model.params)
        self.layout = lay = FlatLayout({n: model.params[n].shape for n in self.names}, ps.dp_size, ps.dp_rank)
        self._slices = [ms.Parameter(ms.Tensor(np.zeros(e - s, np.float32)), name=f"zero1.{'decayed' if d else 'kept'}")
                        for s, e, d in lay.runs]
        groups = [{"params": [p], "weight_decay": weight_decay if d else 0.0}
                  for p, (_, _, d) in zip(self._slices, lay.runs)]
        self._adamw = AdamW(groups, lr=0.0, betas=(beta1, beta2), eps=eps)
        _quiet_constant_tuple_warning()
        # 1 where the owned value counts in the global norm: TP-sharded, or TP rank 0 (replicated)
        counted = np.zeros(lay.shard, np.float32)
        for n, (s, e) in lay.offsets().items():
            if model.is_tp_sharded(n) or ps.tp_rank == 0:
                counted[max(s, lay.lo) - lay.lo:max(min(e, lay.hi) - lay.lo, 0)] = 1.0
        self._counted = ms.Tensor(counted)
        self.step_count = 0

    def state_elements(self) -> int:
        """Moment values this rank holds (exp_avg and exp_avg_sq)."""
        return sum(int(np.prod(m.shape)) for m in list(self._adamw.exp_avg) + list(self._adamw.exp_avg_sq))

    def _flat_params(self):
        return _flatten(ms.mutable(tuple(self.model.params[n] for n in self.layout.order)))

    def _padded(self, flat):
        missing = self.layout.padded - self.layout.total
        return flat if not missing else ops.cat([flat, ops.zeros(missing, flat.dtype)])

    def step_on_local_grads(self, grads: dict, lr: float, max_norm: float):
        """Reduce-scatter, clip, update this rank's slice, all-gather the weights -> the global norm
        before clipping (0-d fp64 tensor). grads: this rank's gradients by name (SP/CP-reduced,
        not DP-reduced)."""
        lay, ps = self.layout, self.ps
        self.step_count += 1
        flat = self._padded(_flatten(ms.mutable(tuple(_tensor(grads[n]) for n in lay.order))))
        mine = self.comm.reduce_scatter(flat, 0, ps.dp_group)
        if ps.dp_size > 1:
            mine = mine / ps.dp_size                # the DP mean, as reduce_gradients' "avg"
        sq = _masked_sum_of_squares(mine, self._counted)
        for size, group in ((ps.dp_size, ps.dp_group), (ps.tp_size, ps.tp_group)):
            if size > 1:
                sq = _fp64_sum_over(self.comm, sq, group)
        if max_norm and max_norm > 0:
            (mine,) = _clipped(ms.mutable((mine,)), sq, ms.Tensor(max_norm, ms.float64))
        weights = self._flat_params()
        for p, (s, e, _) in zip(self._slices, lay.runs):
            ops.assign(p, weights[s:e])
        for group in self._adamw.param_groups:
            ops.assign(group["lr"], ms.Tensor(lr, ms.float32))
        self._adamw(ms.mutable(tuple(mine[s - lay.lo:e - lay.lo] for s, e, _ in lay.runs)))
        self._gather_into_model()
        return ops.sqrt(sq)

    def _own_slice(self, runs_values):
        """This rank's slice (runs + trailing padding) as one [shard] tensor."""
        used = sum(int(v.shape[0]) for v in runs_values)
        parts = list(runs_values) + ([ops.zeros(self.layout.shard - used, ms.float32)]
                                     if used < self.layout.shard else [])
        return ops.cat(parts)

    def _gathered(self, runs_values):
        """Every rank's slice, joined: the whole flat buffer without its padding."""
        whole = self.comm.all_gather(self._own_slice(runs_values), 0, self.ps.dp_group)
        return whole[:self.layout.total]

    def _gather_into_model(self) -> None:
        whole = self._gathered(list(self._slices))
        for n, part in zip(self.layout.order, ops.split(whole, self.layout.sizes)):
            ops.assign(self.model.params[n], part.reshape(self.layout.shapes[n]))

    def state_arrays(self) -> dict:
        """Whole per-parameter moments (every DP rank must call it: an all-gather)."""
        out = {}
        for kind, moments in (("exp_avg", self._adamw.exp_avg), ("exp_avg_sq", self._adamw.exp_avg_sq)):
            whole = self._gathered(list(moments)).asnumpy()
            for n, (s, e) in self.layout.offsets().items():
                out[f"{kind}/{n}"] = whole[s:e].reshape(self.layout.shapes[n])
        return out

    def load_state_arrays(self, shards: dict, step_count: int) -> None:
        """shards: whole (TP-local) moments by name, as Adam takes them; this rank keeps its slice."""
        lay = self.layout
        for kind, moments in (("exp_avg", self._adamw.exp_avg), ("exp_avg_sq", self._adamw.exp_avg_sq)):
            flat = np.concatenate([np.asarray(shards[f"{kind}/{n}"], np.float32).reshape(-1) for n in lay.order])
            for m, (s, e, _) in zip(moments, lay.runs):
                ops.assign(m, ms.Tensor(np.ascontiguousarray(flat[s:e])))
        ops.assign(self._adamw.state_step, ms.Tensor(step_count, ms.int32))
        self.step_count = step_count
