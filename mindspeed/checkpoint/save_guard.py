"""A checkpoint writer process that fails reports its failure instead of hanging the save.

Megatron-Core's torch_dist writer (`FileSystemWriterAsync.write_preloaded_data_multiproc`) forks one
process per shard file, then waits until every one has put its result on a queue and marked itself
done. A writer that raises before its own `try` (Megatron-Core 0.16's reads the process memory with
psutil there) does neither, and the rank waits forever. During a save guarded here every writer
runs under a wrapper that, on such an exception, puts the exception on the results queue and marks
itself done, as Megatron's own writer does for a failure inside its `try`. Megatron then gathers the
failure and raises CheckpointException on every rank (the failing writer's text on the coordinator).
"""
from __future__ import annotations

from contextlib import contextmanager

from mindspeed.errors import one_line


@contextmanager
def writer_failures_reported():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    original = FileSystemWriterAsync.write_preloaded_data
    FileSystemWriterAsync.write_preloaded_data = staticmethod(_reporting(original))
    try:
        yield
    finally:
        FileSystemWriterAsync.write_preloaded_data = staticmethod(original)


class _MarkedDone:
    """The writer's count queue, remembering whether the writer marked itself done."""

    def __init__(self, queue):
        self.queue, self.done = queue, False

    def get(self, *args, **kwargs):
        return self.queue.get(*args, **kwargs)

    def task_done(self):
        self.queue.task_done()
        self.done = True


def _reporting(write):
    """`write` as a forked writer process runs it (Megatron passes the queues by keyword)."""
    def guarded(*args, **kwargs):
        if "count_queue" not in kwargs or "results_queue" not in kwargs:
            return write(*args, **kwargs)       # a Megatron whose writer is called another way
        count_queue = _MarkedDone(kwargs["count_queue"])
        try:
            return write(*args, **dict(kwargs, count_queue=count_queue))
        except BaseException as err:
            if count_queue.done:                 # it reported already; this came after (a closing log)
                return None
            failure = RuntimeError(one_line(f"a checkpoint writer process raised {type(err).__name__}: {err}"))
            kwargs["results_queue"].put((kwargs.get("local_proc_idx", 0), failure))
            count_queue.get()
            count_queue.task_done()
            return None
    return guarded
