"""Megatron's learning-rate schedule (OptimizerParamScheduler.get_lr) in iteration units.

Pure Python: the MindSpore trainer and the torch side of the parity test use the same function.
`step` is the number of optimizer steps already taken (0 for the first iteration).
"""
from __future__ import annotations

import math


def learning_rate(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                  decay_style: str = "cosine", init_lr: float = 0.0) -> float:
    if warmup_steps > 0 and step <= warmup_steps:
        return init_lr + (max_lr - init_lr) * step / warmup_steps
    if decay_style == "constant":
        return max_lr
    if step > decay_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(decay_steps - warmup_steps, 1)
    if decay_style == "linear":
        coeff = 1.0 - ratio
    elif decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"lr decay style {decay_style!r} is not supported by the mindspore trainer "
                         "(constant, linear, cosine)")
    return min_lr + coeff * (max_lr - min_lr)


def from_args(args):
    """step -> lr for the trainer's flags."""
    def lr(step: int) -> float:
        return learning_rate(step, max_lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_iters,
                             decay_steps=args.lr_decay_iters, decay_style=args.lr_decay_style)
    return lr
