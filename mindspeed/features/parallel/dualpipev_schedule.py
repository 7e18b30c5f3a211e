"""DualPipeV's order of work on each pipeline rank, as a pure function (no torch, no process group).

DualPipeV (DeepSeek-V3; the "cut in half" DualPipe) splits the model into 2 x PP stages laid out as a
V: rank r holds stage r (chunk 0, going down) and stage 2PP-1-r (chunk 1, coming back up), so the
embedding and the loss both sit on rank 0 and the last rank turns each micro-batch around locally.
Each rank runs eight phases (DeepSeek's reference order; counts for rank r of P, N micro-batches):

  1. F0 x 2(P-r-1)                      warm-up on the way down
  2. (F0 F1) x (r+1)                    both chunks start
  3. (B1 W F1) x (P-r-1)                zero bubble: the weight gradient fills the wait for F1's input
  4. (F0 B1 F1 B0) x (N-2P+r+1)         steady state: a forward and a backward of other micro-batches
  5. (B1 F1 B0) x (P-r-1)
  6. (B1 B0) x (r+1)
  7. (W B0) x (P-r-1)                   with dw-detach: deferred weight gradients fill the cool-down
  8. W x (r+1)

"B" is a whole backward (input and weight gradients). A backward whose weight gradient is deferred is
"Bi" (input gradient only); its "W" comes later, first deferred first computed. Phase 3 always
defers (as upstream MindSpeed does); phases 6-8 defer only with --dualpipev-dw-detach (upstream's
default keeps the cool-down's backwards whole: activations are freed sooner).
"""
from __future__ import annotations

from collections import namedtuple

Work = namedtuple("Work", "kind chunk mb")     # kind: F, B (whole backward), Bi (input grad only), W


def min_microbatches(pp: int) -> int:
    """The fewest micro-batches per step the V's phases can be laid out with (phase 4 of rank 0)."""
    return 2 * pp - 1


def v_stage(pp: int, rank: int, chunk: int) -> int:
    """The pipeline stage (0 .. 2PP-1) of a rank's chunk: chunk 0 goes down, chunk 1 comes back up."""
    return rank if chunk == 0 else 2 * pp - 1 - rank


def dualpipev_order(pp: int, num_microbatches: int, rank: int, dw_detach: bool = False) -> list[Work]:
    """Rank `rank`'s compute in the order it runs (transfers: schedule_sim.with_transfers)."""
    if pp < 1 or num_microbatches < min_microbatches(pp):
        raise ValueError(f"DualPipeV at PP {pp} needs at least {min_microbatches(pp)} micro-batches, "
                         f"got {num_microbatches}")
    order = _Order()
    p, r, n = pp, rank, num_microbatches
    for _ in range(2 * (p - r - 1)):
        order.forward(0)
    for _ in range(r + 1):
        order.forward(0), order.forward(1)
    for _ in range(p - r - 1):
        order.backward(1, defer=True), order.weight(), order.forward(1)
    for _ in range(n - 2 * p + r + 1):
        order.forward(0), order.backward(1), order.forward(1), order.backward(0)
    for _ in range(p - r - 1):
        order.backward(1), order.forward(1), order.backward(0)
    defer = False
    for i in range(r + 1):      # the second half of the cool-down defers (DeepSeek's zero-bubble switch)
        if dw_detach and i == (r + 1) // 2 and r % 2 == 1:
            defer = True
        order.backward(1, defer)
        if dw_detach and i == (r + 1) // 2 and r % 2 == 0:
            defer = True
        order.backward(0, defer)
    for _ in range(p - r - 1):
        if dw_detach:
            order.weight()
        order.backward(0, dw_detach)
    while order.deferred:
        order.weight()
    return order.items


class _Order:
    """Appends work items, numbering each chunk's micro-batches in the order they reach it."""

    def __init__(self):
        self.items: list[Work] = []
        self.next_f, self.next_b = [0, 0], [0, 0]
        self.deferred: list[Work] = []

    def forward(self, chunk: int) -> None:
        self.items.append(Work("F", chunk, self.next_f[chunk]))
        self.next_f[chunk] += 1

    def backward(self, chunk: int, defer: bool = False) -> None:
        mb = self.next_b[chunk]
        self.next_b[chunk] += 1
        self.items.append(Work("Bi" if defer else "B", chunk, mb))
        if defer:
            self.deferred.append(Work("W", chunk, mb))

    def weight(self) -> None:
        self.items.append(self.deferred.pop(0))
