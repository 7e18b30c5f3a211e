"""A small disk that fills up on purpose: a tmpfs mounted for one test (needs root, as CI runs;
otherwise the test is skipped with that reason), and a filler that leaves only a few bytes free."""
import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def small_tmpfs(path, size_mb: int):
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(path, leave_bytes: int = 4096) -> None:
    """Take all but `leave_bytes` of the file system that holds `path`."""
    stat = os.statvfs(path)
    free = stat.f_bavail * stat.f_frsize
    with open(os.path.join(path, "filler"), "wb") as f:
        f.write(b"\0" * max(0, free - leave_bytes))
