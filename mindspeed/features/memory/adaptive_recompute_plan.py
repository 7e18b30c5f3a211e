"""Which transformer layers recompute so that the activations held for backward fit a budget
(--adaptive-recompute-device-size): a pure function of the profile, framework-free.

A kept layer holds `held_bytes` per micro-batch; a recomputed one holds only its checkpoint (the
layer's inputs, `checkpoint_bytes`) and pays its forward time again in backward. Every micro-batch
in flight (1F1B: up to PP - pipeline rank of them) holds its own copy, so a layer's saving counts
that many times. The greedy choice takes the layers that save the most bytes per second of
recompute first, then gives back any choice the budget no longer needs (fewest recomputed seconds).
"""
from __future__ import annotations

from dataclasses import dataclass

_MIN_SECONDS = 1e-9       # a layer timed at 0 s still has a finite ratio


@dataclass(frozen=True)
class LayerProfile:
    index: int                  # the layer's place in its model chunk (0-based)
    held_bytes: int             # saved for backward per micro-batch when the layer keeps its activations
    checkpoint_bytes: int       # saved per micro-batch when it recomputes (its inputs)
    seconds: float = 0.0        # its forward time: what recomputing it costs

    @property
    def saving(self) -> int:
        return self.held_bytes - self.checkpoint_bytes


@dataclass(frozen=True)
class RecomputePlan:
    recompute: frozenset        # indices of the layers that recompute
    held_bytes: int             # the layers' bytes held for backward under the plan, all micro-batches in flight
    budget_bytes: int

    @property
    def fits(self) -> bool:
        return self.held_bytes <= self.budget_bytes


def choose_layers(profiles, budget_bytes: int, in_flight: int = 1) -> RecomputePlan:
    """The plan for `profiles` (one per layer) under `budget_bytes`; when even recomputing every
    layer that saves bytes does not fit, all of those recompute and the plan says it does not fit."""
    held = sum(p.held_bytes for p in profiles) * in_flight
    useful = [p for p in profiles if p.saving > 0]
    by_value = sorted(useful, key=lambda p: (-p.saving / max(p.seconds, _MIN_SECONDS), p.index))
    chosen = []
    for p in by_value:
        if held <= budget_bytes:
            break
        chosen.append(p)
        held -= p.saving * in_flight
    for p in sorted(chosen, key=lambda p: (-p.seconds, p.index)):    # give back what the budget allows
        if held + p.saving * in_flight <= budget_bytes:
            chosen.remove(p)
            held += p.saving * in_flight
    return RecomputePlan(frozenset(p.index for p in chosen), held, budget_bytes)
