"""Checkpoint directories on disk (Megatron's iter_NNNNNNN layout), shared by the torch and the
MindSpore trainers; framework-free. Each trainer supplies its own check of one iteration.

A save writes into iter_NNNNNNN.partial and renames it to iter_NNNNNNN once every file is written;
the tracker file is written after that. A save killed at any moment therefore leaves the tracked
checkpoint as it was (also when it saves that same iteration again) and, at worst, a .partial
directory that no reader looks at and the next save of that iteration replaces."""
from __future__ import annotations

import os
import re
import shutil
from typing import Callable

ITERATION_DIR = re.compile(r"iter_(\d{7})$")
# Megatron-LM's legacy format (--ckpt-format torch): one directory per model-parallel rank,
# mp_rank_TT, mp_rank_TT_PPP, mp_rank_TT_EEE or mp_rank_TT_PPP_EEE (tensor, pipeline, expert rank)
LEGACY_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def legacy_rank_dirs(directory: str) -> list[str]:
    """The mp_rank_* directories of an iteration directory in Megatron-LM's legacy layout, sorted."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if LEGACY_RANK_DIR.match(n) and os.path.isdir(os.path.join(directory, n)))


def is_legacy(directory: str) -> bool:
    """An iteration directory written in Megatron-LM's legacy per-rank layout (--ckpt-format torch)."""
    return bool(legacy_rank_dirs(directory))


def staging_dir(root: str, iteration: int) -> str:
    return iteration_dir(root, iteration) + ".partial"


def fresh_staging_dir(root: str, iteration: int, mode: int) -> str:
    """An empty iter_NNNNNNN.partial under root (what a killed save left there is removed)."""
    staged = staging_dir(root, iteration)
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(staged, mode=mode)
    os.chmod(staged, mode)
    return staged


def carry_over(root: str, iteration: int) -> None:
    """Files of the published iter_NNNNNNN that the staged save does not write, hard-linked into the
    staging directory: a save that adds a copy beside a checkpoint already there (the converter's
    neutral copy beside its torch_dist files) keeps those files, and the published directory stays
    untouched until publish() swaps it."""
    final, staged = iteration_dir(root, iteration), staging_dir(root, iteration)
    if not os.path.isdir(final):
        return
    for name in os.listdir(final):
        source, target = os.path.join(final, name), os.path.join(staged, name)
        if os.path.isfile(source) and not os.path.exists(target):
            try:
                os.link(source, target)
            except OSError:          # a file system without hard links
                shutil.copy2(source, target)


def publish(root: str, iteration: int) -> str:
    """Rename the finished iter_NNNNNNN.partial to iter_NNNNNNN, replacing an older save of that
    iteration (moved aside first: a directory cannot be renamed over a full one); returns its path."""
    final, staged = iteration_dir(root, iteration), staging_dir(root, iteration)
    if os.path.isdir(final):
        replaced = final + ".replaced"
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
        os.rename(staged, final)
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        os.rename(staged, final)
    return final


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
