"""Training-loop events that features subscribe to (ApplyContext.add_hook) and trainers fire.

Trainers on either backend call `fire("train_step_begin", iteration=i)` and
`fire("train_step_end", iteration=i)`; with nothing adapted or no subscriber it does nothing.
"""
from __future__ import annotations

TRAIN_STEP_BEGIN = "train_step_begin"
TRAIN_STEP_END = "train_step_end"
TRAIN_END = "train_end"


def fire(event: str, **info) -> None:
    from mindspeed.adaptor_core import current
    state = current()
    if state is None:
        return
    for fn in state.context.hooks.get(event, []):
        fn(**info)
