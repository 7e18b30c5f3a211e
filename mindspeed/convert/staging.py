"""--save-dir is written whole or not at all: into a hidden temporary directory beside it, renamed
into place only when everything is written (a failure removes the temporary directory, and the
parent directories it had to create, as Megatron's checkpoint writer creates them)."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager

from mindspeed.errors import ConvertError


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_save_dir(save_dir: str, label: str | None = None,
                   advice: str = "nothing is overwritten: remove it or choose another") -> None:
    """`label` names the directory in a refusal (default: --save-dir SAVE_DIR)."""
    label = label or f"--save-dir {save_dir}"
    if os.path.exists(save_dir) and (not os.path.isdir(save_dir) or os.listdir(save_dir)):
        raise ConvertError(f"{label} already exists and is not an empty directory ({advice})")
    ancestor = _nearest_existing(os.path.dirname(os.path.abspath(save_dir)))
    if not os.path.isdir(ancestor):
        raise ConvertError(f"{label}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConvertError(f"{label}: {ancestor} is not writable")


def _make_parents(parent: str) -> list[str]:
    """Create `parent` and its missing ancestors; returns those created, outermost first."""
    missing = []
    while not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for path in reversed(missing):
        os.mkdir(path)
    return list(reversed(missing))


@contextmanager
def staged(save_dir: str):
    """Yields the temporary directory to write into; on success it becomes save_dir (checked by
    the caller with check_save_dir before any work)."""
    check_save_dir(save_dir)
    target = os.path.abspath(save_dir)
    old_umask = os.umask(0o027)   # the trainer's modes: files 0640, directories 0750
    created = _make_parents(os.path.dirname(target))
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.partial-", dir=os.path.dirname(target))
        try:
            yield tmp
            os.chmod(tmp, 0o750)   # mkdtemp made it 0700
            if os.path.isdir(target):
                os.rmdir(target)          # empty (checked above)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except BaseException:
        for path in reversed(created):
            try:
                os.rmdir(path)
            except OSError:
                break   # no longer empty: something else wrote there meanwhile
        raise
    finally:
        os.umask(old_umask)
