"""Tensor/data-parallel process groups for the MindSpore trainer, built on the backend's comm.

Rank layout follows Megatron: tensor parallel ranks are adjacent (rank = dp_rank * tp + tp_rank).
Every rank creates every group in the same order (collective group creation needs that).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelState:
    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    tp_group: object
    dp_group: object
    sequence_parallel: bool = False


def build_parallel_state(comm, tp_size: int, sequence_parallel: bool = False) -> ParallelState:
    world, rank = comm.world_size(), comm.rank()
    if world % tp_size:
        raise ValueError(f"world size {world} is not divisible by --tensor-model-parallel-size {tp_size}")
    dp_size = world // tp_size
    tp_group = dp_group = None
    for d in range(dp_size):
        ranks = list(range(d * tp_size, (d + 1) * tp_size))
        g = comm.new_group(ranks)
        if rank in ranks:
            tp_group = g
    for t in range(tp_size):
        ranks = list(range(t, world, tp_size))
        g = comm.new_group(ranks)
        if rank in ranks:
            dp_group = g
    return ParallelState(tp_size, dp_size, rank % tp_size, rank // tp_size, tp_group, dp_group,
                         sequence_parallel and tp_size > 1)
