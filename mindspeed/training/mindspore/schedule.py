"""Megatron's learning-rate schedule (OptimizerParamScheduler.get_lr) in iteration units.

Pure Python: the MindSpore trainer and the torch side of the parity test use the same function.
`step` is the number of optimizer steps already taken (0 for the first iteration). Every
--lr-decay-style Megatron-Core accepts: constant, linear, cosine, inverse-square-root and WSD
(warmup, then max_lr until the last `wsd_decay_steps` of the decay, which fall to min_lr in
`wsd_decay_style`). Megatron's scheduler counts samples; with a constant global batch every
ratio it forms is the same in iterations (tested against its own scheduler object), except
inverse-square-root without warmup (1 / sqrt(samples)): `global_batch` gives the samples there.
"""
from __future__ import annotations

import math

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


def _wsd_coeff(step: int, decay_steps: int, wsd_decay_steps: int, style: str) -> float:
    anneal_start = decay_steps - wsd_decay_steps
    if step <= anneal_start:
        return 1.0          # the stable phase
    ratio = (step - anneal_start) / wsd_decay_steps
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"WSD decay style {style!r} is not one of {', '.join(WSD_DECAY_STYLES)}")


def learning_rate(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                  decay_style: str = "cosine", init_lr: float = 0.0, wsd_decay_steps: int | None = None,
                  wsd_decay_style: str = "exponential", global_batch: int = 1) -> float:
    if warmup_steps > 0 and step <= warmup_steps:
        return init_lr + (max_lr - init_lr) * step / warmup_steps
    if decay_style == "constant":
        return max_lr
    if step > decay_steps:
        return min_lr
    if decay_style == "inverse-square-root":
        warmup_samples, samples = max(warmup_steps * global_batch, 1), max(step * global_batch, 1)
        return max(min_lr, max_lr * warmup_samples ** 0.5 / samples ** 0.5)
    ratio = (step - warmup_steps) / max(decay_steps - warmup_steps, 1)
    if decay_style == "linear":
        coeff = 1.0 - ratio
    elif decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    elif decay_style == "WSD":
        coeff = _wsd_coeff(step, decay_steps, wsd_decay_steps, wsd_decay_style)
    else:
        raise ValueError(f"lr decay style {decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
    return min_lr + coeff * (max_lr - min_lr)


def from_args(args):
    """samples -> lr for the trainer's flags: Megatron's scheduler counts the samples of the
    applied steps (its warmup and decay lengths are iterations x --global-batch-size), which a
    --rampup-batch-size run needs; with a constant batch it equals the iteration schedule exactly
    (the same ratios of integers)."""
    gbs = args.global_batch_size
    wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None

    def lr(samples: int) -> float:
        return learning_rate(samples, max_lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_iters * gbs,
                             decay_steps=args.lr_decay_iters * gbs, decay_style=args.lr_decay_style,
                             wsd_decay_steps=wsd, wsd_decay_style=args.lr_wsd_decay_style)
    return lr
