"""Megatron-Core unit tests (core_v0.16.1) that MindSpeed skips on a device without CUDA, each
with what a user loses there. Keys are pytest node ids relative to the Megatron-LM checkout."""
from __future__ import annotations

import re

SKIPS: dict[str, str] = {}

_DIVISIBLE = re.compile(r"world_size \((\d+)\) is not divisible by (\d+)")


def more_ranks_needed(message: str, world_size: int) -> str | None:
    """The skip reason for a test that asks for more processes than the run has, else None."""
    match = _DIVISIBLE.search(message)
    if match is None or int(match.group(1)) != world_size:
        return None
    need = int(match.group(2))
    return (f"needs a multiple of {need} processes, the run has {world_size}: "
            f"torchrun --nproc_per_node {need} -m pytest -p mindspeed.pytest_plugin ...")
