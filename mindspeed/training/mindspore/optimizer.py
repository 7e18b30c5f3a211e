"""Adam with decoupled weight decay (Megatron's Adam = torch.optim.AdamW), gradient reduction
across data/sequence parallel ranks, and global-norm clipping.

The update is MindSpore's own AdamW (`mindspore.experimental.optim.AdamW`, compiled by MindSpore
and writing the parameters and moments in place on the device): no parameter goes to the host and
back. It matches torch.optim.AdamW (tested); on CPU it took 46 ms where the numpy update it replaced
took 85 ms (40 parameters, 1.6M values). Weight decay skips 1-D parameters and biases (Megatron-Core's
default param groups). Gradient reduction and clipping still run on host arrays (the trainer pulls the
gradients out to sum micro-batches). Clipping uses Megatron's rule: coeff = max_norm / (norm + 1e-6),
applied when below 1; the norm counts each TP-replicated parameter once.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import ops
from mindspore.experimental.optim import AdamW


def _quiet_constant_tuple_warning() -> None:
    """AdamW's construct slices the gradients into a tuple per group, and MindSpore's first compile
    warns about it with every gradient value printed (no recompile follows: measured); drop that one."""
    from mindspore import log
    logger = log._get_logger()
    if not any(getattr(f, "mindspeed", False) for f in logger.filters):
        drop = lambda record: "Constant value tensor are detected" not in record.getMessage()
        drop.mindspeed = True
        logger.addFilter(drop)


class Adam:
    def __init__(self, model, *, beta1: float, beta2: float, eps: float, weight_decay: float):
        self.model = model
        self.names = list(model.params)
        decayed = [n for n in self.names if self.decays(n)]
        kept = [n for n in self.names if not self.decays(n)]
        groups = [{"params": [model.params[n] for n in names], "weight_decay": wd}
                  for names, wd in ((decayed, weight_decay), (kept, 0.0)) if names]
        self._adamw = AdamW(groups, lr=0.0, betas=(beta1, beta2), eps=eps)
        _quiet_constant_tuple_warning()
        # AdamW's moment slots follow its groups' order
        self._slot = {n: i for i, n in enumerate(decayed + kept)}
        for n, i in self._slot.items():
            assert self._adamw.exp_avg[i].shape == model.params[n].shape, n
        self.step_count = 0

    def decays(self, name: str) -> bool:
        return len(self.model.params[name].shape) > 1 and not name.endswith(".bias")

    def step(self, grads: dict, lr: float) -> None:
        """grads: numpy arrays by parameter name."""
        self.step_count += 1
        for group in self._adamw.param_groups:
            # in place: the compiled update reads the Parameter (set_data would go unseen)
            ops.assign(group["lr"], ms.Tensor(lr, ms.float32))
        ordered = sorted(self._slot, key=self._slot.get)
        # mutable: new gradient values each step must not recompile the update
        self._adamw(ms.mutable(tuple(ms.Tensor(np.ascontiguousarray(grads[n], np.float32)) for n in ordered)))

    def state_arrays(self) -> dict:
        out = {}
        for name in self.names:
            out[f"exp_avg/{name}"] = self._adamw.exp_avg[self._slot[name]].asnumpy()
            out[f"exp_avg_sq/{name}"] = self._adamw.exp_avg_sq[self._slot[name]].asnumpy()
        return out

    def load_state_arrays(self, shards: dict, step_count: int) -> None:
        for name in self.names:
            i = self._slot[name]
            ops.assign(self._adamw.exp_avg[i], ms.Tensor(np.array(shards[f"exp_avg/{name}"], np.float32)))
            ops.assign(self._adamw.exp_avg_sq[i], ms.Tensor(np.array(shards[f"exp_avg_sq/{name}"], np.float32)))
        ops.assign(self._adamw.state_step, ms.Tensor(step_count, ms.int32))
        self.step_count = step_count


def _flat_all_reduce(comm, arrays: list, op: str, group) -> list:
    """One collective for many arrays: flatten, concatenate, reduce, split back."""
    if not arrays:
        return []
    flat = comm.all_reduce(ms.Tensor(np.concatenate([a.reshape(-1) for a in arrays])), op, group).asnumpy()
    out, start = [], 0
    for a in arrays:
        out.append(flat[start:start + a.size].reshape(a.shape))
        start += a.size
    return out


def reduce_gradients(backend, ps, model, grads: dict) -> dict:
    """Sum over context-parallel ranks, average over data-parallel replicas; with SP, sum the replicated (norm, row-bias) weights'
    partial gradients over the TP group (each rank saw only its sequence shard)."""
    comm = backend.comm
    names = list(grads)
    if ps.sequence_parallel:
        replicated = [n for n in names if not model.is_tp_sharded(n)]
        for n, g in zip(replicated, _flat_all_reduce(comm, [grads[n] for n in replicated], "sum", ps.tp_group)):
            grads[n] = g
    if getattr(ps, "cp_size", 1) > 1:   # each CP rank's gradient covers its share of the sequence
        for n, g in zip(names, _flat_all_reduce(comm, [grads[n] for n in names], "sum", ps.cp_group)):
            grads[n] = g
    if ps.dp_size > 1:
        for n, g in zip(names, _flat_all_reduce(comm, [grads[n] for n in names], "avg", ps.dp_group)):
            grads[n] = g
    return grads


def clip_gradients(backend, ps, model, grads: dict, max_norm: float) -> float:
    """Scale gradients in place to global norm <= max_norm; return the norm before clipping."""
    sq = sum(float(np.square(g, dtype=np.float64).sum()) for n, g in grads.items()
             if model.is_tp_sharded(n) or ps.tp_rank == 0)
    if ps.tp_size > 1:
        sq = float(backend.comm.all_reduce(ms.Tensor([sq], ms.float32), "sum", ps.tp_group).asnumpy()[0])
    norm = math.sqrt(sq)
    if max_norm and max_norm > 0:
        coeff = max_norm / (norm + 1.0e-6)
        if coeff < 1.0:
            for name in grads:
                grads[name] = grads[name] * np.float32(coeff)
    return norm
