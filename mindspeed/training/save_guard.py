"""A checkpoint save whose writer processes fail ends the save with one line instead of hanging.

Megatron-Core's torch_dist writer (`FileSystemWriterAsync.write_preloaded_data_multiproc`) forks one
process per shard file and waits until every one has marked itself done. A writer that raises
before it reaches its own `try` (Megatron-Core 0.16's reads the process memory with psutil there)
never marks itself done, and the rank waits forever. During a save guarded here every writer
process runs under a wrapper that, on any exception, writes one line to a pipe and exits; a
watcher thread of the rank reads the line and interrupts the rank's main thread with SIGUSR1,
whose handler raises CheckpointError. The rank then exits with that line, and the launcher
(torchrun) ends the other ranks.
"""
from __future__ import annotations

import os
import select
import signal
import threading
from contextlib import contextmanager

from mindspeed.training.errors import CheckpointError, one_line

_SIGNAL = signal.SIGUSR1


@contextmanager
def writer_failures_raise(what: str):
    """Within the block, a failing writer process raises CheckpointError("{what} failed: ...") in
    this (the main) thread. Outside the main thread signals cannot be handled: the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    report_r, report_w = os.pipe()
    stop_r, stop_w = os.pipe()
    failure: list[str] = []

    def on_signal(signum, frame):
        raise CheckpointError(f"{what} failed: {failure[0] if failure else 'a writer process died'}")

    def watch(main_id: int) -> None:
        ready, _, _ = select.select([report_r, stop_r], [], [])
        if report_r in ready:
            failure.append(os.read(report_r, 4096).decode("utf-8", "replace").strip())
            signal.pthread_kill(main_id, _SIGNAL)

    original = FileSystemWriterAsync.write_preloaded_data
    previous = signal.signal(_SIGNAL, on_signal)
    FileSystemWriterAsync.write_preloaded_data = staticmethod(_reporting(original, report_w))
    watcher = threading.Thread(target=watch, args=(threading.get_ident(),), name="save-guard", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        os.write(stop_w, b"x")
        watcher.join()            # after this no signal can come: the handler may be restored
        FileSystemWriterAsync.write_preloaded_data = staticmethod(original)
        signal.signal(_SIGNAL, previous)
        for fd in (report_r, report_w, stop_r, stop_w):
            os.close(fd)


def _reporting(write, report_fd: int):
    """`write` as a forked writer process runs it: an exception is reported on `report_fd`."""
    def guarded(*args, **kwargs):
        try:
            return write(*args, **kwargs)
        except BaseException as err:
            line = one_line(f"a checkpoint writer process (pid {os.getpid()}) raised "
                            f"{type(err).__name__}: {err}")
            try:
                os.write(report_fd, line.encode()[:4000])
            except OSError:       # the save already ended: nobody is waiting for this writer
                pass
            os._exit(1)           # the rank decides what happens next; no second report at exit
    return guarded
