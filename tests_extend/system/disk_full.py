"""A small disk that fills up on purpose: a tmpfs mounted for one test (needs root, as CI runs;
otherwise the test is skipped with that reason), and a filler that leaves only a few bytes free."""
import contextlib
import os
import signal
import subprocess

import pytest

from tests_extend.system.interrupted_run import run_interrupted


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


def fill_while_stopped(disk):
    """An act for run_interrupted: the job's process group stopped while `disk` is filled, then let
    go. A job running on writes its next checkpoint meanwhile, and the filler, sized from the free
    space it saw, then runs out of space itself (seen on a fast machine, 1 in 3)."""
    def act(pid):
        os.killpg(pid, signal.SIGSTOP)
        try:
            fill(disk)
        finally:
            os.killpg(pid, signal.SIGCONT)
    return act


def run_filling_after_first_save(argv, disk, ckpt, log, timeout, **popen) -> tuple[int, str, str]:
    """Start a training (`argv`, its output to `log`), fill `disk` as soon as its first checkpoint
    is tracked, let it run into the full disk: (exit code, output, its one `error:` line). The next
    save must be some iterations later, so that the job is stopped before it begins."""
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    rc, output, _ = run_interrupted(argv, log, tracker.exists, fill_while_stopped(disk), timeout, **popen)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "10"   # the previous one
    os.remove(os.path.join(disk, "filler"))
    return rc, output, errors[0]
