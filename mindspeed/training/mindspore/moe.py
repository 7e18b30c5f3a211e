"""Megatron-Core's MoE layer (local spec: TopKRouter, alltoall dispatcher, SequentialMLP experts,
optional SharedExpertMLP) for the MindSpore GPT, with the math of Megatron-Core 0.16:

- router: logits = x @ W_router^T (no bias, fp32); the top-k experts by logit, their probabilities
  a softmax over those k logits (moe_router_pre_softmax off: softmax after top-k);
- load balancing (--moe-aux-loss-coeff > 0): Switch's loss on the softmax over all experts,
  E * coeff / (k * T^2) * sum_e(sum_t scores[t, e] * tokens_per_expert[e]); like Megatron's
  MoEAuxLossAutoScaler it only adds its gradient (x1) where the probabilities enter the graph,
  so the reported lm loss stays the cross-entropy alone;
- no token dropping: every expert takes every token routed to it;
- expert parallelism: expert e lives on EP rank e // (E / ep); each rank sends the tokens (and
  their probabilities) routed to another rank's experts by all-to-all, the experts run, and a
  second all-to-all brings the outputs back, summed per token;
- expert MLP: fc1 -> SwiGLU or GELU (as the dense MLP) -> x probability (Megatron's
  per_token_scale) -> fc2; shared experts: a dense MLP on the same input, added.

Which tokens go where is decided on the host (numpy) from the top-k indices, so the layer runs in
PyNative (its shapes depend on the routing; the trainer does not trace an MoE model).
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

from mindspeed.checkpoint import neutral as nf
from mindspeed.training.mindspore.layers import linear

def route(logits, topk: int):
    """[T, E] logits -> (probs [T, k], expert indices [T, k]): top-k by logit, softmax over those."""
    top_logits, top_idx = ops.topk(logits, topk)
    return ops.softmax(top_logits, -1), top_idx


def load_balancing_loss(logits, topk: int, coeff: float):
    """Megatron's switch_load_balancing_loss_func on this rank's T tokens (TP = CP = 1)."""
    tokens, experts = logits.shape
    scores = ops.softmax(logits.astype(ms.float32), -1)
    _, chosen = ops.topk(scores, topk)
    per_expert = ops.stop_gradient(ops.one_hot(chosen, experts, ms.Tensor(1.0, ms.float32),
                                               ms.Tensor(0.0, ms.float32)).sum((0, 1)))
    return (scores.sum(0) * per_expert).sum() * (experts * coeff / (topk * tokens * tokens))


def attach_aux_gradient(autograd, probs, aux_loss):
    """probs unchanged; backward adds d(aux_loss) with gradient 1 (MoEAuxLossAutoScaler, whose
    scale is 1 here: the trainer divides all gradients by the micro-batch count itself)."""
    def forward(ctx, p, aux):
        return p * 1.0

    def backward(ctx, dp):
        return dp, ops.ones((), ms.float32)
    return autograd.custom_op(forward, backward)(probs, aux_loss)


class MoELayer:
    """The MoE MLP of decoder layer `i` of `model` (a GPTModel: params, config, backend, ps)."""

    def __init__(self, model, i: int):
        self.model, self.i = model, i
        cfg, ps = model.cfg, model.ps
        self.experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.ep, self.ep_rank = ps.ep_size, ps.ep_rank
        self.local = self.experts // self.ep
        self.first = self.ep_rank * self.local

    def _p(self, suffix):
        return self.model.params[nf.layer_name(self.i, suffix)]

    def _expert_mlp(self, e, x, probs):
        p = lambda s: self.model.params[nf.expert_name(self.i, e, s)]
        h = self.model._activation(linear(x, p("linear_fc1.weight")))
        return linear(h * probs.expand_dims(-1), p("linear_fc2.weight"))

    def __call__(self, x):
        s, b, h = x.shape
        flat = x.reshape(-1, h)
        cfg, backend = self.model.cfg, self.model.backend
        logits = linear(flat, self._p("mlp.router.weight"))
        probs, top_idx = route(logits, self.topk)
        if cfg.moe_aux_loss_coeff > 0:
            probs = attach_aux_gradient(backend.autograd, probs,
                                        load_balancing_loss(logits, self.topk, cfg.moe_aux_loss_coeff))
        out = self._routed(flat, probs, top_idx.asnumpy())
        if cfg.moe_shared_expert_size:
            shared = self.model._activation(linear(flat, self._p("mlp.shared_experts.linear_fc1.weight")))
            out = out + linear(shared, self._p("mlp.shared_experts.linear_fc2.weight"))
        return out.reshape(s, b, h)

    def _routed(self, flat, probs, idx: np.ndarray):
        """Permute this rank's (token, expert) pairs expert-major (Megatron's permute), exchange,
        run the local experts, exchange back, sum each token's k outputs."""
        tokens, h = flat.shape
        order = np.argsort(idx.reshape(-1), kind="stable")          # expert-major, tokens ascending
        counts = np.bincount(idx.reshape(-1), minlength=self.experts)
        token_of = ms.Tensor((order // self.topk).astype(np.int32))
        sent = ops.cat([ops.gather(flat, token_of, 0),
                        ops.gather(probs.reshape(-1), ms.Tensor(order.astype(np.int32)), 0).expand_dims(-1)], 1)
        every = self._all_counts(counts)                             # [ep, E]: every rank's counts
        to_rank = every.reshape(self.ep, self.ep, self.local).sum(-1)   # [source, destination]
        rows = int(to_rank.max())          # each rank's chunk for each destination, padded to this
        received = self._exchange(self._padded_chunks(sent, to_rank[self.ep_rank], rows))
        outputs = self._run_experts(received, every, rows, h)
        back = self._exchange(outputs)
        mine = np.concatenate([r * rows + np.arange(to_rank[self.ep_rank, r]) for r in range(self.ep)])
        per_pair = ops.gather(back, ms.Tensor(mine.astype(np.int32)), 0)      # [T*k, h], permuted order
        return ops.unsorted_segment_sum(per_pair, token_of, tokens)

    def _all_counts(self, counts: np.ndarray) -> np.ndarray:
        if self.ep == 1:
            return counts[None]
        comm, group = self.model.backend.comm, self.model.ps.ep_group
        gathered = comm.all_gather(ms.Tensor(counts.astype(np.float32))[None], 0, group)
        return np.rint(gathered.asnumpy()).astype(np.int64)

    @staticmethod
    def _padded_chunks(sent, per_destination: np.ndarray, rows: int):
        """[ep * rows, h + 1]: destination r's pairs first in its chunk, zero rows after."""
        parts, start = [], 0
        for n in per_destination:
            n = int(n)
            if n:
                parts.append(sent[start:start + n])
            if rows - n:
                parts.append(ops.zeros((rows - n, sent.shape[1]), sent.dtype))
            start += n
        return ops.cat(parts, 0) if len(parts) > 1 else parts[0]

    def _exchange(self, buffer):
        if self.ep == 1:
            return buffer
        return self.model.backend.comm.all_to_all_autograd(buffer, 0, 0, self.model.ps.ep_group)

    def _run_experts(self, received, every: np.ndarray, rows: int, h: int):
        """received [ep * rows, h + 1] (chunk s from source s: its pairs for this rank's experts,
        expert-major) -> the outputs [ep * rows, h] in the same rows (zeros in the padding)."""
        mine = every[:, self.first:self.first + self.local]         # [source, local expert]
        starts = np.cumsum(mine, axis=1) - mine
        outputs, at = [], []
        for j in range(self.local):
            where = np.concatenate([s * rows + starts[s, j] + np.arange(mine[s, j]) for s in range(self.ep)])
            if not where.size:           # no token for this expert: its weights get zero gradient
                continue
            pairs = ops.gather(received, ms.Tensor(where.astype(np.int32)), 0)
            outputs.append(self._expert_mlp(self.first + j, pairs[:, :h], pairs[:, h]))
            at.append(where)
        if not outputs:      # still a function of `received`: every rank's backward runs the reverse all-to-all
            return received[:, :h] * 0.0
        return ops.unsorted_segment_sum(ops.cat(outputs, 0), ms.Tensor(np.concatenate(at).astype(np.int32)),
                                        received.shape[0])
