"""Checkpoint directories on disk (Megatron's iter_NNNNNNN layout), shared by the torch and the
MindSpore trainers; framework-free. Each trainer supplies its own check of one iteration."""
from __future__ import annotations

import os
import re
from typing import Callable

ITERATION_DIR = re.compile(r"iter_(\d{7})$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def checkpoint_iterations(root: str) -> list[int]:
    """The iterations with an iter_NNNNNNN directory under root, newest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = (ITERATION_DIR.match(n) for n in names)
    return sorted((int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0)))),
                  reverse=True)


def last_readable(root: str, check_iteration: Callable[[str], str | None], exclude: int | None = None) -> int | None:
    """The newest iteration under root (other than `exclude`) whose directory passes
    check_iteration (which returns a problem, or None when the files are readable)."""
    for iteration in checkpoint_iterations(root):
        if iteration != exclude and check_iteration(iteration_dir(root, iteration)) is None:
            return iteration
    return None
