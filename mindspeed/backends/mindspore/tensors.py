"""TensorAPI on MindSpore."""
from __future__ import annotations

from mindspore import ops

from mindspeed.backends.base import TensorAPI


class MsTensors(TensorAPI):
    def cat(self, tensors, dim: int = 0):
        return ops.cat(tuple(tensors), dim)

    def split(self, tensor, sizes, dim: int = 0):
        return list(ops.split(tensor, sizes if isinstance(sizes, int) else tuple(sizes), dim))
