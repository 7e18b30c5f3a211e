"""Adam with decoupled weight decay (Megatron's Adam = torch.optim.AdamW), gradient reduction
across data/sequence parallel ranks, and global-norm clipping.

The update runs in numpy on fp32 host copies: parameters are small next to activations here, and
one numpy expression costs microseconds where a MindSpore PyNative op dispatch costs about a
millisecond on CPU. Weight decay skips 1-D parameters and biases (Megatron-Core's default param
groups). Clipping uses Megatron's rule: coeff = max_norm / (norm + 1e-6), applied when below 1;
the norm counts each TP-replicated parameter once.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import ops


class Adam:
    def __init__(self, model, *, beta1: float, beta2: float, eps: float, weight_decay: float):
        self.model = model
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.names = list(model.params)
        self.exp_avg = {n: np.zeros(model.params[n].shape, np.float32) for n in self.names}
        self.exp_avg_sq = {n: np.zeros(model.params[n].shape, np.float32) for n in self.names}
        self.step_count = 0

    def decays(self, name: str) -> bool:
        return len(self.model.params[name].shape) > 1 and not name.endswith(".bias")

    def step(self, grads: dict, lr: float) -> None:
        """grads: numpy arrays by parameter name."""
        self.step_count += 1
        b1, b2 = self.beta1, self.beta2
        bias1 = 1.0 - b1 ** self.step_count
        bias2_sqrt = math.sqrt(1.0 - b2 ** self.step_count)
        for name in self.names:
            p = self.model.params[name]
            g, m, v = grads[name], self.exp_avg[name], self.exp_avg_sq[name]
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            v += (1.0 - b2) * g * g
            value = p.asnumpy()
            if self.decays(name):
                value = value * np.float32(1.0 - lr * self.weight_decay)
            denom = np.sqrt(v) / np.float32(bias2_sqrt) + np.float32(self.eps)
            # in place (set_data would swap the storage a traced graph already holds)
            ops.assign(p, ms.Tensor((value - np.float32(lr / bias1) * m / denom).astype(np.float32)))

    def state_arrays(self) -> dict:
        out = {}
        for name in self.names:
            out[f"exp_avg/{name}"] = self.exp_avg[name]
            out[f"exp_avg_sq/{name}"] = self.exp_avg_sq[name]
        return out

    def load_state_arrays(self, shards: dict, step_count: int) -> None:
        for name in self.names:
            self.exp_avg[name] = np.array(shards[f"exp_avg/{name}"], np.float32)
            self.exp_avg_sq[name] = np.array(shards[f"exp_avg_sq/{name}"], np.float32)
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
