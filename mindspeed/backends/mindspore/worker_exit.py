"""How a MindSpore worker ends once its work is done: without MindSpore's exit handler, where the
launcher allows it.

MindSpore 2.10 registers an exit handler at import that finalizes the cluster node and frees its
runtime. Now and then a worker dies inside it, after its work is done and written, with SIGSEGV or
`std::system_error` and no Python frame (docs/native-crash.md): msrun then reports the whole job
failed. The handler's one job that matters to a finished worker is telling msrun's scheduler that
it is leaving; a worker that skips it is, for the scheduler, a node that stopped sending heartbeats,
and the job fails after MS_NODE_TIMEOUT. `python -m mindspeed.msrun` on a single-node job tells
its workers (LAUNCHER_ENV) that it ends the scheduler itself once every worker has exited 0; then
the workers agree at `finish` (an all-reduce, so none leaves while others still work and is timed
out) and, where every rank succeeded, each flushes its output and leaves with os._exit. The
all-reduce must go through the shared-memory collectives: over MCCL a rank that leaves right after
it can close its socket before a peer's last send of that all-reduce is through (seen: "Broadcast
wait sending ... failed"). Anywhere else (plain msrun, a multi-node job, a world on MCCL, a rank
that failed) the process ends as Python and MindSpore normally end it.
"""
from __future__ import annotations

import logging
import os
import sys

import numpy as np

LAUNCHER_ENV = "MINDSPEED_MSRUN_ENDS_SCHEDULER"


def launcher_ends_scheduler() -> bool:
    return os.environ.get(LAUNCHER_ENV) == "1" and os.environ.get("MS_ROLE") == "MS_WORKER"


def finish(code: int) -> int:
    """Every worker calls this at its end with its exit code. Returns `code` (for
    `sys.exit(finish(...))`) unless the launcher ends the scheduler, the world's collectives go
    through shared memory and every rank's code is 0: then the process ends here, skipping the exit
    handlers."""
    if not launcher_ends_scheduler():
        return code
    from mindspeed.backends.mindspore.comm import shared_memory_world
    world = shared_memory_world()
    if world is None:
        return code
    failed = world.all_reduce_sum(np.array([float(code != 0)], np.float32))
    if float(failed[0]) != 0.0:
        return code
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):       # closed by the program
            pass
    os._exit(0)
