"""Tensor/context/data-parallel process groups for the MindSpore trainer, on the backend's comm.

Rank layout follows Megatron: tensor-parallel ranks are adjacent, then context-parallel, then
data-parallel (rank = (dp_rank * cp + cp_rank) * tp + tp_rank). Every rank creates every group in
the same order (collective group creation needs that).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelState:
    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    tp_group: object
    dp_group: object
    sequence_parallel: bool = False
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: object = None
    all_cp_ranks: list = field(default_factory=list)   # every CP group's global ranks
    tp_linear: object = None     # a feature's TP linears (--use-ascend-coc's CocLinears), else layers.py's


def build_parallel_state(comm, tp_size: int, sequence_parallel: bool = False, cp_size: int = 1) -> ParallelState:
    world, rank = comm.world_size(), comm.rank()
    if world % (tp_size * cp_size):
        raise ValueError(f"world size {world} is not divisible by tensor ({tp_size}) x context ({cp_size}) "
                         "parallel sizes")
    dp_size = world // (tp_size * cp_size)
    at = lambda d, c, t: (d * cp_size + c) * tp_size + t
    groups = {}
    tp_lists = [[at(d, c, t) for t in range(tp_size)] for d in range(dp_size) for c in range(cp_size)]
    cp_lists = [[at(d, c, t) for c in range(cp_size)] for d in range(dp_size) for t in range(tp_size)]
    dp_lists = [[at(d, c, t) for d in range(dp_size)] for c in range(cp_size) for t in range(tp_size)]
    for kind, lists in (("tp", tp_lists), ("cp", cp_lists), ("dp", dp_lists)):
        for ranks in lists:
            g = comm.new_group(ranks)
            if rank in ranks:
                groups[kind] = g
    tp_rank, cp_rank, dp_rank = rank % tp_size, (rank // tp_size) % cp_size, rank // (tp_size * cp_size)
    return ParallelState(tp_size, dp_size, tp_rank, dp_rank, groups["tp"], groups["dp"],
                         sequence_parallel and tp_size > 1, cp_size, cp_rank, groups["cp"], cp_lists)
