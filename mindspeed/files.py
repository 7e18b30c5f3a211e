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


def atomic_write_text(path: str, text: str, mode: int = PRIVATE_FILE) -> None:
    """atomic_write of a text file holding exactly `text` (UTF-8)."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    atomic_write(path, write, mode)


def private_dir(path: str) -> None:
    os.makedirs(path, mode=PRIVATE_DIR, exist_ok=True)
    os.chmod(path, PRIVATE_DIR)


class UnsafeArchive(ValueError):
    """A member of an archive would land outside the folder it is unpacked into, or is not a plain
    file, folder or link (one line that names the member)."""


def safe_extract(archive: str, dest: str) -> None:
    """Unpack the tar `archive` into `dest`, refusing the whole archive (before anything is written)
    when a member has an absolute path or `..` that leaves `dest`, is a link whose target leaves it,
    or is a device file or FIFO. Modes lose setuid/setgid and group/other write; files belong to the
    caller. The same check runs on every Python: tarfile's `filter="data"` exists only from 3.11.4,
    and where it exists it runs as well."""
    import tarfile
    root = os.path.realpath(dest)
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        for member in members:
            _vet_member(member, root, archive)
            member.mode &= 0o755
            member.uid, member.gid, member.uname, member.gname = os.getuid(), os.getgid(), "", ""
        os.makedirs(root, exist_ok=True)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(root, members=members, filter="data")
        else:
            tar.extractall(root, members=members)


def _vet_member(member, root: str, archive: str) -> None:
    def inside(path: str) -> bool:
        return os.path.commonpath([root, path]) == root

    where = os.path.normpath(os.path.join(root, member.name))
    if os.path.isabs(member.name) or not inside(where):
        raise UnsafeArchive(f"{archive}: member {member.name!r} would be written outside {root}; not unpacked")
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        raise UnsafeArchive(f"{archive}: member {member.name!r} is a device file or FIFO; not unpacked")
    if member.issym():
        target = os.path.normpath(os.path.join(os.path.dirname(where), member.linkname))
    elif member.islnk():
        target = os.path.normpath(os.path.join(root, member.linkname))
    else:
        return
    if os.path.isabs(member.linkname) or not inside(target):
        raise UnsafeArchive(f"{archive}: link {member.name!r} points to {member.linkname!r}, outside {root}; "
                            "not unpacked")
