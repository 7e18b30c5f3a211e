"""Where MindSpeed keeps its caches, and how it writes a file so that no reader ever sees half of it.

One cache root for everything MindSpeed caches (the bundled corpus, preprocessed data, built C++
kernels, the measured peak FLOP/s): `$MINDSPEED_CACHE_DIR`, else `$XDG_CACHE_HOME/mindspeed`, else
`~/.cache/mindspeed`.
"""
from __future__ import annotations

import os
from typing import Callable

CACHE_ENV = "MINDSPEED_CACHE_DIR"
PRIVATE_FILE = 0o640      # checkpoints, datasets, tokenizers: owner writes, group reads
PRIVATE_DIR = 0o750


def cache_root() -> str:
    root = os.environ.get(CACHE_ENV)
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "mindspeed")
    return os.path.expanduser(root)


def cache_path(*parts: str) -> str:
    return os.path.join(cache_root(), *parts)


def atomic_write(path: str, write: Callable[[str], None], mode: int = PRIVATE_FILE) -> None:
    """write(tmp) fills a temporary file beside `path`, which then replaces `path` in one rename:
    a crash leaves the old file or none, never a partial one (and no temporary file behind)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def private_dir(path: str) -> None:
    os.makedirs(path, mode=PRIVATE_DIR, exist_ok=True)
    os.chmod(path, PRIVATE_DIR)
