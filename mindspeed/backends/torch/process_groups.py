"""The process groups Megatron-Core's `destroy_model_parallel` forgets, destroyed.

`parallel_state.destroy_model_parallel` sets its group globals to None and destroys only the gloo
groups it asked for by name; the groups made with its default backend (nccl) are left to torch.
NCCL builds a communicator on a group's first collective, so a forgotten group costs little on a
GPU. Where gloo stands in for nccl, each group opens its connections and starts its worker threads
when it is made, and keeps them until it is destroyed: every initialize/destroy cycle (Megatron's
unit tests run one per test) would leave its groups' threads behind. The wrap destroys the groups
parallel_state held that are still registered once the original has run.
"""
from __future__ import annotations

import types

import torch.distributed as dist

_CONTAINERS = (list, tuple, set, dict)


def held_process_groups(module: types.ModuleType) -> list:
    """The process groups a module's globals hold, directly or in lists, tuples, sets and dicts
    (parallel_state keeps some groups in lists and dicts keyed by rank layout)."""
    found: dict[int, dist.ProcessGroup] = {}
    for name, value in vars(module).items():
        if not name.startswith("__"):
            _collect(value, found, depth=0)
    return list(found.values())


def _collect(value, found: dict, depth: int) -> None:
    # a module-level function, not a recursive closure: a closure that refers to itself is a
    # reference cycle, which would keep the groups (and their threads) alive until the next gc
    if isinstance(value, dist.ProcessGroup):
        found[id(value)] = value
    elif depth < 3 and isinstance(value, _CONTAINERS):
        for item in (value.values() if isinstance(value, dict) else value):
            _collect(item, found, depth + 1)


def destroy_still_registered(groups: list) -> int:
    """Destroy each group torch still has registered, except the default (world) group; the count."""
    if not dist.is_initialized():
        return 0     # the world is gone, and with it every group
    registered = dist.distributed_c10d._world.pg_map     # what destroy_process_group itself checks
    world = dist.distributed_c10d._get_default_group()
    destroyed = 0
    for group in groups:
        if group is not world and group in registered:
            dist.destroy_process_group(group)
            destroyed += 1
    return destroyed


def wrap_destroy_model_parallel(parallel_state: types.ModuleType):
    """A wrapper maker for `parallel_state.destroy_model_parallel` (PatchManager.wrap)."""

    def wrapper(original):
        def destroy_model_parallel(*args, **kwargs):
            held = held_process_groups(parallel_state)
            result = original(*args, **kwargs)
            destroy_still_registered(held)
            return result
        return destroy_model_parallel

    return wrapper
