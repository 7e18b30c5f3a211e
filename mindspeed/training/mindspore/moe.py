"""Megatron-Core's MoE layer (local spec: TopKRouter, alltoall dispatcher, SequentialMLP experts,
optional SharedExpertMLP) for the MindSpore GPT, with the math of Megatron-Core 0.16:

- router: logits = x @ W_router^T (no bias, fp32); the top-k experts by logit, their probabilities
  a softmax over those k logits (moe_router_pre_softmax off: softmax after top-k);
- load balancing (--moe-aux-loss-coeff > 0): Switch's loss on the softmax over all experts,
  E * coeff / (k * T^2) * sum_e(sum_t scores[t, e] * tokens_per_expert[e]); like Megatron's
  MoEAuxLossAutoScaler it only adds its gradient (x1) where the probabilities enter the graph,
  so the reported lm loss stays the cross-entropy alone;
- expert bias (--moe-router-enable-expert-bias, sigmoid scores): the bias of expert_bias.py added to the
  scores for choosing the top-k only; the layer reports each call's tokens per expert to it;
- no token dropping: every expert takes every token routed to it;
- expert parallelism: expert e lives on EP rank e // (E / ep); each rank sends the tokens (and
  their probabilities) routed to another rank's experts by all-to-all, the experts run, and a
  second all-to-all brings the outputs back, summed per token;
- --moe-tp-extend-ep (TP > 1 with sequence parallelism): the EP group is the TP x EP block
  (parallel.py), so each rank routes its own sequence shard's tokens to whole experts spread over
  the TP ranks too (Megatron-Core's expert TP 1, EP x TP); the router's weight is replicated over
  TP, its gradient summed there like the norms' (optimizer.reduce_gradients), and the
  load-balancing loss counts tokens per expert over the TP ranks;
- --moe-token-dispatcher-type allgather (Megatron-Core's MoEAllGatherTokenDispatcher): every EP
  rank's tokens and their probabilities all-gathered (one collective, so each backward runs one
  reduce-scatter), each rank's experts run on every token routed to them, and the outputs summed
  back to the tokens' ranks by a reduce-scatter; the same sums as the alltoall dispatcher's;
- expert TP (TP > 1 with sequence parallelism, no --moe-tp-extend-ep, EP 1: Megatron-Core's
  expert_tensor_parallel_size defaults to TP): each TP rank holds its slice of every expert (fc1's
  columns, fc2's rows, split as the dense MLP's); as Megatron-Core's alltoall dispatcher at expert
  TP > 1, the TP ranks' sequence shards are all-gathered, each rank permutes them all, runs its
  slices, sums the rows back per token, and a reduce-scatter over TP adds the slices' partial
  outputs, each rank keeping its own shard;
- expert MLP: fc1 -> SwiGLU or GELU (as the dense MLP) -> x probability (Megatron's
  per_token_scale) -> fc2; shared experts: a dense MLP on the same input, added.

Which tokens go where is decided on the host (numpy) from the top-k indices, so the layer runs in
PyNative (its shapes depend on the routing; the trainer does not trace an MoE model).

The MoE features change how the layer gets there, the results staying the same (`schedule` lists
the steps of the last call, in order):
- --use-fused-moe-token-permute-and-unpermute: the backend's moe_permute / moe_unpermute kernels
  permute the tokens and sum them back, in place of the host's argsort and a segment sum;
- --moe-grouped-gemm: the local experts run as two grouped GEMMs (the backend's gmm kernel over
  the stacked expert weights) in place of one MLP per expert; with --gemm-gradient-accumulation-fusion
  their weight gradients go into fp32 main grads (main_grad.py);
- --moe-alltoall-overlap-comm: dispatch, experts and combine run once per chunk (part c of every
  expert's block, as the torch hook cuts them), one chunk after the other: MindSpore's CPU
  collectives have no all-to-all to overlap (comm.py builds it from AllReduce), so nothing overlaps;
- --moe-permutation-async-comm: the token counts' all-gather is started asynchronously and the
  tokens are permuted while it travels;
- --moe-shared-expert-overlap: the shared experts run before the dispatch (Megatron's overlap
  order), not after the combine.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

from mindspeed.checkpoint import neutral as nf
from mindspeed.features.moe.chunks import CHUNKS, piece
from mindspeed.training.mindspore.layers import linear, stacked
from mindspeed.training.mindspore.router_settings import SOFTMAX_TOPK, RouterSettings

def _one_hot_sum(indices, n: int):
    """[T, k] indices -> [T, n]: 1.0 where chosen (each index once per row)."""
    return ops.one_hot(indices, n, ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32)).sum(1)


def _topk(scores, topk: int, router: RouterSettings):
    """Top-k of [T, E] scores, limited to the router's best groups where it has groups (Megatron-Core's
    group_limited_topk: a group's score is the sum of its best topk / group_topk experts' scores)."""
    if not router.group_topk:
        return ops.topk(scores, topk)
    tokens, experts = scores.shape
    groups = router.num_groups
    group_scores = ops.topk(scores.reshape(tokens, groups, experts // groups), topk // router.group_topk)[0].sum(-1)
    chosen = _one_hot_sum(ops.topk(group_scores, router.group_topk)[1], groups)
    mask = chosen.expand_dims(-1).broadcast_to((tokens, groups, experts // groups)).reshape(tokens, experts)
    return ops.topk(ops.where(mask > 0, scores, ops.full_like(scores, float("-inf"))), topk)


def route(logits, topk: int, router: RouterSettings = SOFTMAX_TOPK, expert_bias=None):
    """[T, E] logits -> (probs [T, k], expert indices [T, k]) as Megatron-Core's
    topk_routing_with_score_function: softmax after the top-k (before it with pre_softmax), or sigmoid
    scores normalized over the k chosen; times the scaling factor. expert_bias [E] (sigmoid only,
    expert_bias.py): added to the scores for choosing the experts, the probabilities the unbiased scores."""
    if router.score_function == "sigmoid":
        scores = ops.sigmoid(logits.astype(ms.float32))
        if expert_bias is None:
            top, top_idx = _topk(scores, topk, router)
        else:
            top_idx = _topk(ops.stop_gradient(scores) + expert_bias, topk, router)[1]
            top = ops.gather_elements(scores, 1, top_idx)
        probs = top / (top.sum(-1, keepdims=True) + 1e-20) if topk > 1 else top
    elif router.pre_softmax:
        probs, top_idx = _topk(ops.softmax(logits.astype(ms.float32), -1), topk, router)
    else:
        top, top_idx = _topk(logits, topk, router)
        probs = ops.softmax(top, -1)
    if router.scaling_factor:
        probs = probs * router.scaling_factor
    return probs, top_idx


def aux_loss_scores(logits, score_function: str = "softmax"):
    """Megatron-Core's compute_routing_scores_for_aux_loss: the scores over all experts (sigmoid ones
    normalized per token)."""
    if score_function == "sigmoid":
        scores = ops.sigmoid(logits.astype(ms.float32))
        return scores / (scores.sum(-1, keepdims=True) + 1e-20)
    return ops.softmax(logits.astype(ms.float32), -1)


def load_balancing_loss(logits, topk: int, coeff: float, sum_over_sequence=None, ranks: int = 1,
                        score_function: str = "softmax", sequences: int = 0):
    """Megatron's switch_load_balancing_loss_func on this rank's T tokens; under sequence
    parallelism (ranks > 1: this rank holds T of the ranks * T tokens) the tokens per expert summed
    over the sequence-parallel ranks by sum_over_sequence, the probabilities this rank's (Megatron's
    tp_cp reduction: the ranks' partial losses and their router gradients add up).
    sequences > 0: the sequence-level loss (seq_aux_loss, --seq-aux) of T tokens laid out [s, sequences]:
    each sequence's experts counted apart (Megatron-Core reshapes [s x b, E] to [s, b x E]), the sum over
    the sequences divided by their number."""
    tokens, experts = logits.shape
    scores = aux_loss_scores(logits, score_function)
    _, chosen = ops.topk(scores, topk)
    hits = _one_hot_sum(chosen, experts)
    if sequences:
        scores, hits = scores.reshape(-1, sequences * experts), hits.reshape(-1, sequences * experts)
        tokens = tokens // sequences
    per_expert = ops.stop_gradient(hits.sum(0))
    if ranks > 1:
        per_expert = ops.stop_gradient(sum_over_sequence(per_expert))
    total = tokens * ranks
    loss = (scores.sum(0) * per_expert).sum() * (experts * coeff / (topk * total * total))
    return loss / sequences if sequences else loss


def attach_aux_gradient(autograd, probs, aux_loss):
    """probs unchanged; backward adds d(aux_loss) with gradient 1 (MoEAuxLossAutoScaler, whose
    scale is 1 here: the trainer divides all gradients by the micro-batch count itself)."""
    def forward(ctx, p, aux):
        return p * 1.0

    def backward(ctx, dp):
        return dp, ops.ones((), ms.float32)
    return autograd.custom_op(forward, backward)(probs, aux_loss)


class MoELayer:
    """The MoE MLP of layer `i` of `model` (a GPTModel: params, config, backend, ps): a decoder layer, or past
    the decoder an MTP layer (mtp.py), its weights under model.layer_name."""

    def __init__(self, model, i: int):
        self.model, self.i = model, i
        cfg, ps = model.cfg, model.ps
        self.experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.ep, self.ep_rank = ps.ep_size, ps.ep_rank
        self.local = self.experts // self.ep
        self.first = self.ep_rank * self.local
        self.fused_permute = "moe_permute" in cfg.fused_kernels
        self.grouped_gemm = "gmm" in cfg.fused_kernels
        self.chunks = CHUNKS if "moe-alltoall-overlap-comm" in cfg.moe_dispatch else 1
        self.async_counts = "moe-permutation-async-comm" in cfg.moe_dispatch
        self.shared_first = "moe-shared-expert-overlap" in cfg.moe_dispatch
        self.schedule: list[str] = []

    def _p(self, suffix):
        return self.model.params[self.model.layer_name(self.i, suffix)]

    def _expert_weight(self, e, suffix):      # an MTP layer's experts under its own names (model.layer_name)
        return self.model.params[self.model.layer_name(self.i, f"{nf.EXPERTS}{e}.{suffix}")]

    def _expert_mlp(self, e, x, probs):
        h = self.model._activation(linear(x, self._expert_weight(e, "linear_fc1.weight")))
        return linear(h * probs.expand_dims(-1), self._expert_weight(e, "linear_fc2.weight"))

    def __call__(self, x):
        s, b, h = x.shape
        flat = x.reshape(-1, h)
        cfg, backend = self.model.cfg, self.model.backend
        self.schedule = []
        router = cfg.moe_router
        weight = self._p("mlp.router.weight")
        logits = linear(flat.astype(ms.float32), weight.astype(ms.float32)) if router.fp32 else linear(flat, weight)
        bias = self.model.expert_bias
        probs, top_idx = route(logits, self.topk, router, None if bias is None else ms.Tensor(bias.bias[self.i]))
        if cfg.moe_aux_loss_coeff > 0 and router.load_balancing in ("aux_loss", "seq_aux_loss"):
            ps = self.model.ps
            sp = ps.tp_size if ps.sequence_parallel else 1
            aux = load_balancing_loss(logits, self.topk, cfg.moe_aux_loss_coeff,
                                      lambda t: backend.comm.all_reduce(t, "sum", ps.tp_group), sp,
                                      router.score_function, b if router.load_balancing == "seq_aux_loss" else 0)
            probs = attach_aux_gradient(backend.autograd, probs, aux)
        idx = top_idx.asnumpy()
        counts = np.bincount(idx.reshape(-1), minlength=self.experts)
        if bias is not None:
            bias.routed(self.i, counts)
        if cfg.moe_allgather:
            shared = self._shared(flat) if self.shared_first and cfg.moe_shared_expert_size else None
            return self._with_shared(self._allgather_dispatch(flat, probs, idx), shared, flat).reshape(s, b, h)
        if cfg.experts_tp_sharded:
            shared = self._shared(flat) if self.shared_first and cfg.moe_shared_expert_size else None
            return self._with_shared(self._tp_dispatch(flat, probs, idx), shared, flat).reshape(s, b, h)
        counts_of_every_rank = self._start_counts(counts)
        if self.async_counts:        # permuted while the counts travel
            sent, unpermute = self._permute(flat, probs, top_idx, idx)
        shared = self._shared(flat) if self.shared_first and cfg.moe_shared_expert_size else None
        every = counts_of_every_rank()
        if not self.async_counts:
            sent, unpermute = self._permute(flat, probs, top_idx, idx)
        return self._with_shared(unpermute(self._routed(sent, every)), shared, flat).reshape(s, b, h)

    def _with_shared(self, out, shared, flat):
        """The routed experts' output plus the shared experts' (computed now unless `shared` already is)."""
        if not self.model.cfg.moe_shared_expert_size:
            return out
        return out + (shared if shared is not None else self._shared(flat))

    def _shared(self, flat):
        self.schedule.append("shared")
        shared = self.model._activation(linear(flat, self._p("mlp.shared_experts.linear_fc1.weight")))
        return linear(shared, self._p("mlp.shared_experts.linear_fc2.weight"))

    def _permute(self, flat, probs, top_idx, idx: np.ndarray):
        """-> ([T*k, h + 1] this rank's (token, expert) pairs expert-major, tokens ascending within an
        expert (Megatron's permute), each row its token and its probability; the function that sums
        [T*k, h] rows in that order back to their tokens)."""
        tokens = flat.shape[0]
        if self.fused_permute:
            self.schedule.append("permute:kernel")
            kernel = self.model.kernel
            chosen = ops.one_hot(top_idx, self.experts, ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32))
            routing_map = chosen.sum(1) > 0                                  # [T, E]
            permuted, sorted_indices = kernel("moe_permute")(flat, routing_map)
            pair_probs = ops.masked_select((chosen * probs.expand_dims(-1)).sum(1).T, routing_map.T)
            return (ops.cat([permuted, pair_probs.expand_dims(-1)], 1),
                    lambda rows: kernel("moe_unpermute")(rows, sorted_indices, None, (tokens, flat.shape[1])))
        self.schedule.append("permute:host")
        order = np.argsort(idx.reshape(-1), kind="stable")
        token_of = ms.Tensor((order // self.topk).astype(np.int32))
        sent = ops.cat([ops.gather(flat, token_of, 0),
                        ops.gather(probs.reshape(-1), ms.Tensor(order.astype(np.int32)), 0).expand_dims(-1)], 1)
        return sent, lambda rows: ops.unsorted_segment_sum(rows, token_of, tokens)

    def _allgather_dispatch(self, flat, probs, idx: np.ndarray):
        """[T, h] tokens, [T, k] probabilities and expert indices -> [T, h]: the allgather dispatcher."""
        tokens, k, h = flat.shape[0], self.topk, flat.shape[1]
        comm, group = self.model.backend.comm, self.model.ps.ep_group
        mine = ops.cat([flat, probs.astype(flat.dtype)], 1)
        every = comm.all_gather_autograd(mine, 0, group) if self.ep > 1 else mine       # [ep * T, h + k]
        choices = idx.reshape(-1)
        if self.ep > 1:
            gathered = comm.all_gather(ms.Tensor(idx.astype(np.float32)), 0, group)
            choices = np.rint(gathered.asnumpy()).astype(np.int64).reshape(-1)
        self.schedule.append("allgather")
        local = choices - self.first
        held = np.nonzero((local >= 0) & (local < self.local))[0]
        pairs = held[np.argsort(local[held], kind="stable")]     # (token, slot) pairs, expert-major
        if not pairs.size:     # still a function of `every`: its backward's reduce-scatter runs on every rank
            out = every[:, :h] * 0.0
        else:
            token_of = ms.Tensor((pairs // k).astype(np.int32))
            pair_probs = ops.gather(every[:, h:].reshape(-1), ms.Tensor(pairs.astype(np.int32)), 0)
            sent = ops.cat([ops.gather(every[:, :h], token_of, 0), pair_probs.expand_dims(-1)], 1)
            sizes = np.bincount(local[pairs], minlength=self.local)
            out = ops.unsorted_segment_sum(self._local_experts(sent, list(sizes), h), token_of, every.shape[0])
        self.schedule.append("reduce-scatter")
        return comm.reduce_scatter_autograd(out, 0, group) if self.ep > 1 else out[:tokens]

    def _tp_dispatch(self, flat, probs, idx: np.ndarray):
        """[T, h] tokens (this TP rank's sequence shard), [T, k] probabilities and expert indices -> [T, h]
        for experts split over TP at EP 1: the TP ranks' tokens gathered, through this rank's slices of
        every expert, the partial outputs reduce-scattered (summed over TP, each rank its shard)."""
        comm, group, h = self.model.backend.comm, self.model.ps.tp_group, flat.shape[1]
        self.schedule.append("allgather")
        every = comm.all_gather_autograd(ops.cat([flat, probs.astype(flat.dtype)], 1), 0, group)
        choices = comm.all_gather(ms.Tensor(idx.astype(np.float32)), 0, group)
        every_idx = np.rint(choices.asnumpy()).astype(np.int64)                   # [tp * T, k]
        sent, unpermute = self._permute(every[:, :h], every[:, h:], ms.Tensor(every_idx.astype(np.int32)), every_idx)
        sizes = np.bincount(every_idx.reshape(-1), minlength=self.experts)
        out = unpermute(self._local_experts(sent, list(sizes), h))
        self.schedule.append("reduce-scatter")
        return comm.reduce_scatter_autograd(out, 0, group)

    def _start_counts(self, counts: np.ndarray):
        """Start gathering every EP rank's tokens per expert; -> the function that returns them [ep, E]."""
        if self.ep == 1:
            return lambda: counts[None]
        comm, group = self.model.backend.comm, self.model.ps.ep_group
        mine = ms.Tensor(counts.astype(np.float32))[None]
        if self.async_counts:
            self.schedule.append("counts:start")
            handle = comm.all_gather_async(mine, 0, group)
            gathered = handle.wait
        else:
            self.schedule.append("counts")
            done = comm.all_gather(mine, 0, group)
            gathered = lambda: done

        def wait():
            if self.async_counts:
                self.schedule.append("counts:wait")
            return np.rint(gathered().asnumpy()).astype(np.int64)
        return wait

    def _routed(self, sent, every: np.ndarray):
        """sent [P, h + 1] (this rank's pairs, expert-major), every [ep, E] (every rank's pairs per
        expert) -> the experts' outputs [P, h] in the same order: all pairs at once, or chunk c of
        every expert's block at a time."""
        if self.chunks == 1:
            return self._through_experts(sent, every)
        starts = np.cumsum(every[self.ep_rank]) - every[self.ep_rank]
        parts, order = [], []
        for c in range(self.chunks):
            bounds = [[piece(int(n), c, self.chunks) for n in row] for row in every]
            every_c = np.array([[b - a for a, b in row] for row in bounds])
            rows = np.concatenate([starts[e] + np.arange(a, b) for e, (a, b) in enumerate(bounds[self.ep_rank])])
            if not every_c.any():     # every rank sees the same counts: all skip this chunk
                continue
            # a rank with no pair in this chunk still joins its exchanges (zero rows only)
            chunk = ops.gather(sent, ms.Tensor(rows.astype(np.int32)), 0) if rows.size else sent
            out = self._through_experts(chunk, every_c)
            if rows.size:
                parts.append(out)
                order.append(rows)
        back_to_order = np.argsort(np.concatenate(order), kind="stable")
        return ops.gather(ops.cat(parts, 0), ms.Tensor(back_to_order.astype(np.int32)), 0)

    def _through_experts(self, sent, every: np.ndarray):
        """Exchange, run the local experts, exchange back: [P, h] outputs of this rank's P pairs."""
        h = sent.shape[1] - 1
        to_rank = every.reshape(self.ep, self.ep, self.local).sum(-1)   # [source, destination]
        rows = int(to_rank.max())          # each rank's chunk for each destination, padded to this
        self.schedule.append("dispatch")
        received = self._exchange(self._padded_chunks(sent, to_rank[self.ep_rank], rows))
        outputs = self._run_experts(received, every, rows, h)
        self.schedule.append("combine")
        back = self._exchange(outputs)
        mine = np.concatenate([r * rows + np.arange(to_rank[self.ep_rank, r]) for r in range(self.ep)])
        return ops.gather(back, ms.Tensor(mine.astype(np.int32)), 0)

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
        where = [np.concatenate([s * rows + starts[s, j] + np.arange(mine[s, j]) for s in range(self.ep)])
                 for j in range(self.local)]
        if not any(w.size for w in where):  # still a function of `received`: every rank's backward runs the reverse all-to-all
            self.schedule.append("experts:none")
            return received[:, :h] * 0.0
        at = ms.Tensor(np.concatenate(where).astype(np.int32))
        out = self._local_experts(ops.gather(received, at, 0), [w.size for w in where], h)
        return ops.unsorted_segment_sum(out, at, received.shape[0])

    def _local_experts(self, pairs, sizes: list, h: int):
        """pairs [M, h + 1] sorted by local expert (sizes[j] rows for expert j) -> [M, h]: one grouped
        GEMM per projection, or one MLP per expert."""
        if self.grouped_gemm:
            self.schedule.append("experts:gmm")
            return self._grouped_experts(pairs, sizes, h)
        self.schedule.append("experts:loop")
        outputs, start = [], 0
        for j, n in enumerate(sizes):
            if n:   # no token for this expert: its weights get zero gradient
                part = pairs[start:start + int(n)]
                outputs.append(self._expert_mlp(self.first + j, part[:, :h], part[:, h]))
            start += int(n)
        return ops.cat(outputs, 0)

    def _grouped_experts(self, pairs, sizes: list, h: int):
        """pairs [M, h + 1] sorted by local expert (sizes[j] rows for expert j) -> [M, h]: fc1, the
        activation, x probability, fc2, each GEMM one gmm over the local experts' weights [L, K, N]."""
        gmm, main_grads = self.model.kernel("gmm"), self.model.ps.main_grads
        weights = lambda suffix: [self._expert_weight(self.first + j, suffix) for j in range(self.local)]
        if main_grads is not None and main_grads.experts:     # --gemm-gradient-accumulation-fusion
            grouped = lambda x, suffix: main_grads.grouped_linear(gmm, x, weights(suffix), sizes)
        else:
            grouped = lambda x, suffix: gmm(x, stacked(weights(suffix)), sizes, 1)
        hidden = self.model._activation(grouped(pairs[:, :h], "linear_fc1.weight"))
        return grouped(hidden * pairs[:, h:], "linear_fc2.weight")
