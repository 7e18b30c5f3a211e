"""Training-loop events the trainers publish to the features subscribed in the active plan.

Trainers on either backend call `fire(TRAIN_STEP_BEGIN, iteration=i)` and
`fire(TRAIN_STEP_END, iteration=i)`; with nothing adapted or no subscriber it does nothing.
"""
from __future__ import annotations

from mindspeed.adaptor_core import current
from mindspeed.features.base import TRAIN_END, TRAIN_STEP_BEGIN, TRAIN_STEP_END  # noqa: F401 (the trainers' names)


def fire(event: str, **info) -> None:
    state = current()
    if state is not None:
        state.context.publish(event, **info)
