"""A blocking all-reduce over a group of one process returns at once on the cpu.

Over one rank an all-reduce with sum, product, min, max or a bitwise op leaves the tensor as it is,
but gloo still runs its algorithm and a wait for it: 0.1-0.2 ms each, several times a step in a
one-process run (the loss, the gradient norm's model-parallel reduction). Asynchronous calls keep
the collective (their caller waits on the work object it returns), as do ops that change values
on one rank (PREMUL_SUM scales).
"""
from __future__ import annotations

import torch.distributed as dist

SITE = "torch.distributed.all_reduce"
UNCHANGED_ON_ONE_RANK = (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX,
                         dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR)


def _wrap_all_reduce(original):
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not async_op and op in UNCHANGED_ON_ONE_RANK and dist.get_world_size(group) == 1:
            return None
        return original(tensor, op, group, async_op)
    return all_reduce


def apply_one_rank_all_reduce(patcher) -> None:
    patcher.wrap(SITE, _wrap_all_reduce, reason="an all-reduce over one rank changes nothing",
                 aliases="torch.distributed")
