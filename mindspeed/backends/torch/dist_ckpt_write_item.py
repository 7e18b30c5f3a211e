"""Megatron-Core 0.12's checkpoint writer against the torch this project pins.

Megatron-Core's torch_dist writer (dist_checkpointing/strategies/filesystem_async.py) writes each
item through torch's private `filesystem._write_item`. torch 2.6 added a required
`serialization_format` argument to it; Megatron-Core 0.16 asks torch's signature and passes it,
0.12 does not, so every torch_dist save of Megatron-LM core_v0.12.1 stops with "_write_item()
missing 1 required positional argument" in the writer's worker and "results_queue should not be
empty" on every rank. The writer's `_write_item` becomes torch's, given the format torch's own
FileSystemWriter uses by default (torch.save's, what torch wrote before the argument existed) only
when a call leaves it out: 0.16's calls, which name it, pass through unchanged. Applied on every
device: it is torch's API, not the device's.
"""
from __future__ import annotations

import functools
import inspect

WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
ARGUMENT = "serialization_format"


def _with_default_format(write_item, default_format):
    position = list(inspect.signature(write_item).parameters).index(ARGUMENT)

    # torch's signature stays visible (0.16's writer asks it, then names the argument)
    @functools.wraps(write_item)
    def write_item_with_format(*args, **kwargs):
        if len(args) <= position and ARGUMENT not in kwargs:
            kwargs[ARGUMENT] = default_format
        return write_item(*args, **kwargs)
    return write_item_with_format


def apply_write_item_format(patcher) -> None:
    import importlib

    from torch.distributed.checkpoint import filesystem
    if ARGUMENT not in inspect.signature(filesystem._write_item).parameters:
        return          # a torch from before the argument: Megatron's call is complete
    importlib.import_module(WRITER)
    default = filesystem.SerializationFormat.TORCH_SAVE
    patcher.replace(f"{WRITER}._write_item", _with_default_format(filesystem._write_item, default),
                    reason=f"torch's _write_item needs {ARGUMENT}: where Megatron-Core's writer leaves it out, "
                           "torch.save's format, torch's own default")
