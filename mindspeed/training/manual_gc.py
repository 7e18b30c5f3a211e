"""--manual-gc (Megatron's, in MindSpeed-LLM's recipes): Python's cyclic garbage collector runs at
fixed points instead of whenever allocations trigger it, so that every rank pauses at the same
step (an automatic collection on one rank stalls the others at the next collective)."""
from __future__ import annotations

import gc


class ManualGC:
    """Off during training; a collection every `interval` steps (0: none) and around evaluation
    and checkpoints, as Megatron-LM does; the collector's own state is restored on exit."""

    def __init__(self, args):
        self.on = bool(args.manual_gc)
        self.interval = int(args.manual_gc_interval or 0)
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> "ManualGC":
        if self.on:
            gc.disable()
            gc.collect()
        return self

    def after_step(self, iteration: int) -> None:
        if self.on and self.interval and iteration % self.interval == 0:
            gc.collect()

    def at_pause(self) -> None:
        """Before evaluation or a checkpoint: garbage from the steps goes now, not inside them."""
        if self.on:
            gc.collect()

    def __exit__(self, *exc) -> None:
        if self.on and self._was_enabled:
            gc.enable()
