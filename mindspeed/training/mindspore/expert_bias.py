"""The MoE router's expert bias on the MindSpore trainer (--moe-router-enable-expert-bias, MindSpeed-LLM's
noaux_tc): Megatron-Core 0.16's aux-loss-free balancing (router.py's expert_bias buffer,
finalize_model_grads._update_router_expert_bias, moe_utils.get_updated_expert_bias).

Each MoE layer keeps an fp32 bias [E] that is added to the sigmoid scores for choosing the top-k experts
only (the probabilities stay the unbiased scores, moe.route). The tokens each expert got in the step's
training forwards are counted per layer; after the step's backward the counts are summed over the TP, CP
and DP ranks, and every bias moves by `rate` towards balance: bias += sign(mean count - count) x rate.
The biases are state, not parameters (no gradient, no optimizer): checkpoints hold them under Megatron's
name, decoder.layers.<i>.mlp.router.expert_bias (an MTP layer's: mtp.layers.<k>.transformer_layer.mlp.router.expert_bias,
counted and moved as the decoder's, as Megatron's finalize_model_grads finds every router with a bias)."""
from __future__ import annotations

import numpy as np

from mindspeed.training.mindspore import mtp

BIAS_SUFFIX = "mlp.router.expert_bias"


class ExpertBias:
    """The biases and token counts of the MoE layers `names` (global index -> checkpoint name of its bias;
    every MoE layer of the model, so every pipeline stage names the same checkpoint tensors)."""

    def __init__(self, names: dict, experts: int, rate: float):
        self.names, self.experts, self.rate = dict(names), experts, np.float32(rate)
        self.layers = list(self.names)
        self.bias = {i: np.zeros(experts, np.float32) for i in self.layers}
        self._counted = {i: np.zeros(experts, np.float32) for i in self.layers}
        self._last = {}

    def routed(self, i: int, tokens_per_expert: np.ndarray) -> None:
        """Layer i's latest forward routed these counts; a recomputed forward routes the same tokens
        again and replaces them, so a micro-batch is counted once (end_micro_batch)."""
        self._last[i] = tokens_per_expert.astype(np.float32)

    def end_micro_batch(self) -> None:
        """A training micro-batch's forward and backward are done: add its counts (evaluation never
        calls this, so its forwards count nothing, as Megatron counts only with gradients on)."""
        for i, counts in self._last.items():
            self._counted[i] += counts
        self._last = {}

    def update(self, comm, groups) -> None:
        """After the step's backward (Megatron's finalize_model_grads): the counts summed over `groups`
        (TP, CP, DP: Megatron's tensor-and-data-parallel group with CP), each bias moved by the rate's
        sign step towards the mean count, the counts zeroed."""
        import mindspore as ms
        counts = ms.Tensor(np.stack([self._counted[i] for i in self.layers]))
        for group in groups:
            counts = comm.all_reduce(counts, "sum", group)
        counts = counts.asnumpy()
        offset = counts.sum(-1, keepdims=True) / np.float32(self.experts) - counts
        for row, i in enumerate(self.layers):
            self.bias[i] = (self.bias[i] + np.sign(offset[row]).astype(np.float32) * self.rate).astype(np.float32)
            self._counted[i][:] = 0.0

    def arrays(self) -> dict:
        """The biases by checkpoint name."""
        return {self.names[i]: self.bias[i].copy() for i in self.layers}

    def load(self, full: dict) -> None:
        """Take the biases from whole checkpoint tensors; a checkpoint without them (saved without
        the expert bias) starts them at zero, as Megatron's buffer starts."""
        for i in self.layers:
            saved = full.get(self.names[i])
            self.bias[i] = np.zeros(self.experts, np.float32) if saved is None else np.asarray(saved, np.float32)


def for_model(cfg):
    """The model's ExpertBias, or None without --moe-router-enable-expert-bias."""
    if not (cfg.num_experts and cfg.moe_router.expert_bias):
        return None
    return ExpertBias({i: mtp.layer_param_name(cfg.num_layers, i, BIAS_SUFFIX) for i in cfg.moe_layers()},
                      cfg.num_experts, cfg.moe_router.bias_update_rate)


def count_groups(ps) -> list:
    """The groups the counts are summed over: TP, CP and DP, those with more than one rank."""
    return [group for group, size in ((ps.tp_group, ps.tp_size), (ps.cp_group, ps.cp_size), (ps.dp_group, ps.dp_size))
            if size > 1]
