"""Megatron-Core hook of --moe-zero-memory (torch backend).

One wrap per experts class (SequentialMLP, GroupedMLP, TEGroupedMLP) acts on every experts call of
an MoE layer, chunk by chunk under --moe-alltoall-overlap-comm's pipeline, so each chunk's recompute
runs inside that chunk's expert backward, while the other chunks' gradient all-to-alls travel.
--moe-zero-memory-num-layers: the TransformerLayer hook (layer_init.py) marks the experts of the
layers past N (local index in the model chunk), which then run as Megatron's; an MoE layer built
outside a TransformerLayer has no index and recomputes.

level0 reuses Megatron's own MLP.forward for the activation (megatron_recompute._activation, the
probabilities passed as its per_token_scale), through backend.memory.recompute_output; level1 runs
the experts' forward through backend.memory.recompute.

COUNTS (read by the tests and the benchmark): recomputes run in backward, and how many of them ran
while a gradient all-to-all of the overlap was in flight (async_comm's backward counters).
"""
from __future__ import annotations

import functools

from mindspeed.features.memory import layer_init
from mindspeed.features.memory.megatron_recompute import _activation
from mindspeed.features.moe import async_comm

EXPERTS = "megatron.core.transformer.moe.experts"
EXPERT_CLASSES = ("SequentialMLP", "GroupedMLP", "TEGroupedMLP")
SKIP = "_mindspeed_zero_memory_skip"
COUNTS = {"recomputed": 0, "under_comm": 0}


def reset_counts() -> None:
    COUNTS.update(recomputed=0, under_comm=0)


def _count_recompute() -> None:
    COUNTS["recomputed"] += 1
    if async_comm.COUNTS["bwd_started"] > async_comm.COUNTS["bwd_waited"]:
        COUNTS["under_comm"] += 1


def _counted(fn):
    """fn, counting every call after the first (the first is the forward, the others backward's rebuild)."""
    calls = []

    def run(*args):
        if calls:
            _count_recompute()
        calls.append(None)
        return fn(*args)
    return run


def _skip_layers_past(limit, layer, arguments) -> None:
    experts = getattr(layer.mlp, "experts", None)
    if experts is not None and arguments["layer_number"] > limit:
        setattr(experts, SKIP, True)


# level0 -----------------------------------------------------------------------------------------
def _expert_mlp_forward(mlp, memory, hidden_states, per_token_scale=None, **kwargs):
    """An expert MLP's forward with its activation x probabilities freed after fc2, rebuilt in backward."""
    from megatron.core.transformer.mlp import MLP
    x, bias = mlp.linear_fc1(hidden_states)
    act = memory.recompute_output(
        _counted(lambda x, bias, scale: _activation(mlp, MLP.forward, x, bias, scale)), x, bias, per_token_scale)
    output, output_bias = mlp.linear_fc2(act.output)
    act.discard(output)
    if per_token_scale is not None and output_bias is not None:     # an expert's bias, weighted as Megatron does
        output = output + output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
        output_bias = None
    return output, output_bias


def _with_expert_activation_recompute(experts, memory, run):
    """run() with each expert MLP of `experts` forwarding through _expert_mlp_forward."""
    from megatron.core.transformer.mlp import MLP
    mlps = [m for m in experts.modules() if isinstance(m, MLP)]
    for mlp in mlps:                    # instance attribute: nn.Module.__call__ finds it before the class's
        mlp.forward = functools.partial(_expert_mlp_forward, mlp, memory)
    try:
        return run()
    finally:
        for mlp in mlps:
            del mlp.__dict__["forward"]


# the experts' forward ---------------------------------------------------------------------------
def _wrap_experts_forward(original, memory, level):
    def forward(self, hidden_states, tokens_per_expert, probs):
        if getattr(self, SKIP, False):
            return original(self, hidden_states, tokens_per_expert, probs)
        if level == "level0":
            return _with_expert_activation_recompute(
                self, memory, lambda: original(self, hidden_states, tokens_per_expert, probs))
        return memory.recompute(_counted(lambda h, p: original(self, h, tokens_per_expert, p)), hidden_states, probs)
    return forward


def install(patcher, args, memory) -> None:
    """The experts' hooks, recomputing through `memory` (the run's backend.memory)."""
    import importlib
    module = importlib.import_module(EXPERTS)
    level, limit = args.moe_zero_memory, args.moe_zero_memory_num_layers
    why = f"--moe-zero-memory {level}: the experts' activations recomputed in backward"
    for cls in EXPERT_CLASSES:
        if hasattr(module, cls):
            patcher.wrap(f"{EXPERTS}.{cls}.forward", functools.partial(_wrap_experts_forward, memory=memory,
                                                                       level=level), reason=why)
    if limit is not None:
        layer_init.add_hook(patcher, functools.partial(_skip_layers_past, limit),
                            "--moe-zero-memory-num-layers: the layers past N keep their experts' activations")
