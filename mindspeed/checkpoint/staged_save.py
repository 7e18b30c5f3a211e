"""The steps of a save shared by both torch checkpoint formats (torch_dist.py, legacy.py): rank 0 makes
a fresh iter_NNNNNNN.partial, every rank writes its files there, rank 0 renames it to iter_NNNNNNN
and then writes the tracker (scan: a save killed or failing midway leaves the tracked checkpoint as
it was).

Every step ends with every rank agreeing on its outcome (`agreed`: an all-gather of each rank's
problem, which is also the barrier between steps), so a step that fails on one rank (rank 0's
publish, say) stops every rank with the same one-line CheckpointError instead of leaving the others
waiting at a barrier for a rank that has already raised.
"""
from __future__ import annotations

import errno
import os
from typing import Callable

import torch

from mindspeed.checkpoint import scan
from mindspeed.errors import CheckpointError, one_line
from mindspeed.files import PRIVATE_DIR, PRIVATE_FILE, atomic_write_text

TRACKER = "latest_checkpointed_iteration.txt"


def agreed(problem: str | None, name_rank: bool = False) -> str | None:
    """The first failing rank's problem (naming the rank with name_rank; None when no rank has one), the
    same on every rank; a barrier."""
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, problem)
    return next((f"{p} (rank {rank})" if name_rank else p for rank, p in enumerate(every) if p), None)


def write_failure(path: str, err: BaseException) -> str:
    """One phrase for a failed write of `path`. torch.save reports a full disk as a RuntimeError about
    stream positions: the file system's free space names the cause."""
    if isinstance(err, OSError) and err.strerror:
        cause = err.strerror
    else:
        try:
            stat = os.statvfs(os.path.dirname(path) or ".")
            full = stat.f_bavail * stat.f_frsize < 1 << 20
        except OSError:
            full = False
        cause = os.strerror(errno.ENOSPC) if full else one_line(f"{type(err).__name__}: {err}", 200)
    return f"{path}: {cause}"


def restrict_permissions(path: str) -> None:
    """Everything under `path` 0640 (files) / 0750 (directories)."""
    for dirpath, _dirnames, filenames in os.walk(path):
        os.chmod(dirpath, PRIVATE_DIR)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), PRIVATE_FILE)


def _on_rank0(step: Callable[[], None], failed_path: str) -> str | None:
    """Run `step` on rank 0 only: its OSError as a problem phrase (None elsewhere, or when it worked)."""
    if torch.distributed.get_rank() != 0:
        return None
    try:
        step()
    except OSError as err:
        return write_failure(failed_path, err)
    return None


def _raise_if(path: str, problem: str | None) -> None:
    if problem:
        raise CheckpointError(f"saving {path} failed: {problem}; the tracker still names the last complete "
                              "checkpoint")


def staged_save(root: str, iteration: int, write: Callable[[str], str | None]) -> str:
    """Save iteration `iteration` under `root`: write(staging directory) on every rank writes this
    rank's files there and returns its problem (None when it worked; it may raise a CheckpointError
    itself where every rank raises the same). Returns the published iteration directory."""
    path, staged = scan.iteration_dir(root, iteration), scan.staging_dir(root, iteration)

    def stage():
        os.makedirs(root, mode=PRIVATE_DIR, exist_ok=True)
        scan.fresh_staging_dir(root, iteration, PRIVATE_DIR)

    def publish():
        scan.publish(root, iteration)
        atomic_write_text(os.path.join(root, TRACKER), str(iteration), PRIVATE_FILE)
        restrict_permissions(root)

    _raise_if(path, agreed(_on_rank0(stage, staged), name_rank=True))
    _raise_if(path, agreed(write(staged), name_rank=True))
    _raise_if(path, agreed(_on_rank0(publish, path), name_rank=True))
    return path
