"""--fp16 on the MindSpore trainer: Megatron-Core's loss scaling (grad_scaler.py) and the
unscale / overflow check of its MixedPrecisionOptimizer; --bf16's fp32 main gradients (no scaling).

The model computes in fp16 (model.py keeps fp32 masters beside its fp16 weights); the loss is
multiplied by the scale before backward, the fp16 gradients are taken to fp32, unscaled and checked
for inf/nan; one non-finite value on any rank skips the step everywhere and lowers the scale.
The optimizer (MindSpore's own, plain or distributed) updates the fp32 masters, and the fp16
weights are rounded from them (GPTModel.copy_from_masters).
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

from mindspeed.flags.checks import dynamic_loss_scaling


class LossScaler:
    """Megatron-Core's DynamicGradScaler (growth 2, backoff 0.5): after `hysteresis` overflows in a
    row the scale halves (not below min_scale); after `window` clean steps it doubles and the
    hysteresis budget is restored. dynamic=False is its ConstantGradScaler (--loss-scale)."""

    def __init__(self, scale: float, *, dynamic: bool = True, min_scale: float = 1.0, window: int = 1000,
                 hysteresis: int = 2):
        self.scale, self.dynamic = float(scale), dynamic
        self.min_scale, self.window, self.hysteresis = float(min_scale), int(window), int(hysteresis)
        self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis
                self.scale *= 2.0

    def inv_scale(self) -> float:
        # torch's: the fp64 reciprocal, rounded to fp32
        return float(np.float32(1.0 / self.scale))

    def state_dict(self) -> dict:
        """Megatron's grad_scaler state (empty for a constant scale, as ConstantGradScaler's)."""
        if not self.dynamic:
            return {}
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        if self.dynamic and state:
            self.scale = float(state["scale"])
            self.growth_tracker, self.hysteresis_tracker = int(state["growth_tracker"]), int(state["hysteresis_tracker"])


def scaler_from_args(args) -> LossScaler | None:
    """None unless --fp16; --loss-scale is a constant scale, else dynamic with Megatron's defaults."""
    if not args.fp16:
        return None
    if args.loss_scale is not None:
        return LossScaler(args.loss_scale, dynamic=False)
    value = dynamic_loss_scaling(args)
    return LossScaler(value["initial_loss_scale"], min_scale=value["min_loss_scale"],
                      window=int(value["loss_scale_window"]), hysteresis=int(value["hysteresis"]))


class MasterWeights:
    """What the optimizers need of a model (named Parameters, which are TP-sharded), over the fp32
    masters: MindSpore's optimizer updates these, never the fp16 weights."""

    def __init__(self, model):
        self.params = model.master_params()
        self.is_tp_sharded = model.is_tp_sharded
        self.counted_in_grad_norm = model.counted_in_grad_norm


@ms.jit
def _unscaled_fp32(grads, inv_scale):
    """fp32 gradients times inv_scale, and 1.0 if any value is inf/nan (0.0 if none)."""
    out = tuple([g.astype(ms.float32) * inv_scale for g in grads])
    bad = ops.zeros((), ms.float32)
    for g in out:
        bad = ops.maximum(bad, ops.logical_not(ops.isfinite(g)).any().astype(ms.float32))
    return out, bad


def bf16_main_grads(grads: tuple) -> tuple:
    """--bf16: the fp32 copies of the bf16 gradients the optimizer reads and the ranks reduce (Megatron's
    main_grad; the torch trainer reduces in fp32 too, grad_reduce_in_fp32). Already fp32 after an
    accumulation over micro-batches."""
    if all(g.dtype == ms.float32 for g in grads):
        return tuple(grads)
    return tuple(g.astype(ms.float32) for g in grads)


def unscale_and_check(comm, grads: tuple, scaler: LossScaler) -> tuple[tuple, bool]:
    """(fp32 unscaled gradients, whether any rank found inf/nan): the flag is summed over the whole
    world, so every DP, TP, PP and CP rank takes the same decision (Megatron all-reduces it over
    the ranks whose gradients differ; the world includes them)."""
    out, bad = _unscaled_fp32(ms.mutable(tuple(grads)), ms.Tensor(scaler.inv_scale(), ms.float32))
    if comm.world_size() > 1:
        bad = comm.all_reduce(bad.reshape(1), "sum")
    return out, bool(float(bad.reshape(-1)[0].asnumpy()) > 0)
