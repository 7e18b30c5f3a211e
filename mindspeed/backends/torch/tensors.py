"""TensorAPI on torch."""
from __future__ import annotations

import torch

from mindspeed.backends.base import TensorAPI


class TorchTensors(TensorAPI):
    def cat(self, tensors, dim: int = 0):
        return torch.cat(list(tensors), dim)

    def split(self, tensor, sizes, dim: int = 0):
        return list(torch.split(tensor, sizes if isinstance(sizes, int) else list(sizes), dim))
