"""--reuse-fp32-param on the MindSpore trainer (--bf16 --use-distributed-optimizer): each fp32 master is
kept as its two 16-bit halves, the high half being the model's bf16 parameter itself and the low half an
int16 residual, so the model holds 2 + 2 bytes per parameter instead of a bf16 weight beside an fp32
master (2 + 4); the distributed optimizer's fp32 slices (4/DP) are the only fp32 copies that persist.

MindSpore Parameters own their storage (a Parameter made from a view of another is a copy), so the
halves cannot be one buffer as in reuse_fp32_param_megatron.py; the arithmetic is the same as there:
the split adds 0x8000 to the fp32 bit pattern, so the bf16 weight is the master rounded to nearest with
ties away from zero, and join subtracts it again, so a master round-trips bit for bit. The plain
optimizer is refused with the flag (the feature's validate): its fp32 Parameters are the masters, and
nothing could be folded away."""
from __future__ import annotations

from collections.abc import Mapping

import mindspore as ms
from mindspore import ops

from mindspeed.backends.mindspore import precision

ROUND = 0x8000


def split(values) -> tuple:
    """fp32 tensor -> (low int16 residual, high bf16 weight), both of its shape."""
    bits = values.astype(ms.float32).reshape(-1).view(ms.int32) + ROUND
    pairs = bits.view(ms.int16).reshape(-1, 2)     # little-endian: the low half first
    low, high = pairs[:, 0].copy(), pairs[:, 1].copy()
    return low.reshape(values.shape), high.view(ms.bfloat16).reshape(values.shape)


def join(low, high):
    """(low int16, high bf16) -> the fp32 master they hold, exactly."""
    pairs = ops.stack([low.reshape(-1), high.reshape(-1).view(ms.int16)], axis=1)
    bits = pairs.reshape(-1).view(ms.int32) - ROUND
    return bits.view(ms.float32).reshape(high.shape)


class FoldedMasters:
    """A model's fp32 masters as the bf16 weights (`params`, the model's Parameters) and their residuals."""

    def __init__(self, params: dict):
        self.params, self.residuals = params, {}

    def write(self, name: str, value) -> None:
        """Master `name` := value (fp32): its bf16 weight and residual rewritten in place."""
        low, high = split(value)
        if name in self.residuals:
            self.residuals[name].copy_(low)
            precision.assign(self.params[name], high)
        else:
            self.residuals[name] = low
            self.params[name] = ms.Parameter(high, name=name)

    def read(self, name: str):
        return join(self.residuals[name], self.params[name])

    def arrays(self) -> dict:
        """Every master as an fp32 tensor (new tensors: what checkpoints hold)."""
        return {name: self.read(name) for name in self.residuals}


class _Reader(Mapping):
    """name -> the master's fp32 value, joined when asked (what the distributed optimizer flattens)."""

    def __init__(self, folded: FoldedMasters):
        self._folded = folded

    def __getitem__(self, name):
        return self._folded.read(name)

    def __iter__(self):
        return iter(self._folded.residuals)

    def __len__(self):
        return len(self._folded.residuals)


class FoldedWeights:
    """What the distributed optimizer needs of a model (mixed_precision.MasterWeights' interface): the
    masters read as fp32 by name, and `write` for the updated values (split back into the halves)."""

    def __init__(self, model):
        self.folded = model.folded
        self.params = _Reader(model.folded)
        self.is_tp_sharded = model.is_tp_sharded
        self.counted_in_grad_norm = model.counted_in_grad_norm

    def write(self, name: str, value) -> None:
        self.folded.write(name, value)
