"""A second stream for a device without one: on CPU, work submitted to a SideStream runs in order on
one worker thread while the host thread computes, as kernels queued on a CUDA stream run beside the
default stream's. torch ops and gloo's collectives release the GIL, so a collective on the worker
overlaps the host's compute for real.

`submit(fn, *args)` returns a Future; the caller waits for it where the work's results are needed
(the stream's events). `intervals` (when recording) holds (label, start, end, thread id) of each piece of
work on either side, in time.perf_counter seconds, for the benchmark's hidden-time count.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time

import torch


class SideStream:
    def __init__(self, name: str = "side"):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mindspeed-{name}")
        self.recording = False
        self.intervals: list[tuple[str, float, float, int]] = []
        self._lock = threading.Lock()

    def submit(self, fn, *args, label: str = "side"):
        grad = torch.is_grad_enabled()          # grad mode is per thread: the worker takes the caller's

        def work():
            with torch.set_grad_enabled(grad):
                return self.timed(label, fn, *args)
        return self._pool.submit(work)

    def timed(self, label: str, fn, *args):
        """Run fn(*args) here, its interval recorded under `label` while recording."""
        if not self.recording:
            return fn(*args)
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            with self._lock:
                self.intervals.append((label, start, time.perf_counter(), threading.get_ident()))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def hidden_seconds(intervals, side_labels) -> float:
    """Seconds of the intervals labelled in `side_labels` (work on the side stream) that lie under the
    other intervals (the host's compute): what the overlap hid. Each side's intervals are disjoint
    (one thread each); a two-pointer sweep over both, in start order."""
    side = sorted((a, b) for label, a, b, *_ in intervals if label in side_labels)
    host = sorted((a, b) for label, a, b, *_ in intervals if label not in side_labels)
    hidden, j = 0.0, 0
    for a, b in side:
        while j < len(host) and host[j][1] <= a:
            j += 1
        k = j
        while k < len(host) and host[k][0] < b:
            hidden += min(b, host[k][1]) - max(a, host[k][0])
            k += 1
    return hidden
