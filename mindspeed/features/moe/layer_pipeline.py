"""Megatron-Core's MoE layer steps taken over by an overlap pipeline (--moe-alltoall-overlap-comm,
--moe-allgather-overlap-comm): `dispatch` only marks the layer, `routed_experts_compute` runs the
feature's pipeline (the dispatcher's communication and the experts, interleaved), `combine` passes
the already-combined output on. A layer the feature does not apply to runs Megatron's own steps.
"""
from __future__ import annotations

import functools

LAYER = "megatron.core.transformer.moe.moe_layer.MoELayer"


def _dispatch(original, applies, pending):
    def dispatch(self, hidden_states, probs):
        if not applies(self):
            return original(self, hidden_states, probs)
        setattr(self, pending, True)
        return hidden_states, probs
    return dispatch


def _routed_experts_compute(original, pipeline, pending):
    def routed_experts_compute(self, hidden_states, probs):
        if not self.__dict__.get(pending, False):
            return original(self, hidden_states, probs)
        return pipeline(self, hidden_states, probs), None
    return routed_experts_compute


def _combine(original, pending):
    def combine(self, output):
        if not self.__dict__.pop(pending, False):
            return original(self, output)
        return output
    return combine


def install(patcher, applies, pipeline, why: str, pending: str) -> None:
    """applies(layer): whether the pipeline takes this layer's call; pipeline(layer, hidden, probs): the
    combined output; `pending`: the layer attribute (one per feature) that carries the mark."""
    # the support matrix has checked these methods exist (the feature's megatron_hooks)
    patcher.wrap(f"{LAYER}.dispatch", functools.partial(_dispatch, applies=applies, pending=pending), reason=why)
    patcher.wrap(f"{LAYER}.routed_experts_compute",
                 functools.partial(_routed_experts_compute, pipeline=pipeline, pending=pending), reason=why)
    patcher.wrap(f"{LAYER}.combine", functools.partial(_combine, pending=pending), reason=why)
