"""--save-dir is written whole or not at all: into a hidden temporary directory beside it, renamed
into place only when everything is written (a failure removes the temporary directory)."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager

from mindspeed.errors import ConvertError


def check_save_dir(save_dir: str) -> None:
    if os.path.exists(save_dir) and (not os.path.isdir(save_dir) or os.listdir(save_dir)):
        raise ConvertError(f"--save-dir {save_dir} already exists and is not an empty directory "
                           "(nothing is overwritten: remove it or choose another)")
    parent = os.path.dirname(os.path.abspath(save_dir))
    if not os.path.isdir(parent):
        raise ConvertError(f"--save-dir {save_dir}: its parent directory {parent} does not exist")


@contextmanager
def staged(save_dir: str):
    """Yields the temporary directory to write into; on success it becomes save_dir."""
    check_save_dir(save_dir)
    target = os.path.abspath(save_dir)
    old_umask = os.umask(0o027)   # the trainer's modes: files 0640, directories 0750
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
    finally:
        os.umask(old_umask)
