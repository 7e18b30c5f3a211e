"""How a MindSpore worker ends once its work is done: without MindSpore's exit handler, where the
launcher allows it.

MindSpore 2.10 registers an exit handler at import that finalizes the cluster node and frees its
runtime. Now and then a worker dies inside it, after its work is done and written, with SIGSEGV or
`std::system_error` and no Python frame (docs/native-crash.md): msrun then reports the whole job
failed. The handler's one job that matters to a finished worker is telling msrun's scheduler that
it is leaving; a worker that skips it is, for the scheduler, a node that stopped sending heartbeats,
and the job fails after MS_NODE_TIMEOUT. `python -m mindspeed.msrun` (on every node of a job) tells
its workers (LAUNCHER_ENV: a folder of its own) that the launcher holding the scheduler stops it
itself once each of its workers has exited 0 and left a mark there. The workers agree at `finish`
(an all-reduce of their failures over the whole world, so none leaves while others still work);
where every rank succeeded, each leaves its mark, flushes its output and ends with os._exit.
The all-reduce goes through the shared-memory collectives where the world has them. Over MCCL a
rank that left right after the all-reduce could close its socket before a peer's last send of it
was through (seen once: "Broadcast wait sending ... failed"), so there each rank waits
MCCL_GRACE_S before it leaves. Anywhere else (plain msrun, the scheduler, a rank that failed) the
process ends as Python and MindSpore normally end it.
"""
from __future__ import annotations

import logging
import os
import sys
import time

import numpy as np

LAUNCHER_ENV = "MINDSPEED_MSRUN_ENDS_SCHEDULER"
MCCL_GRACE_S = 2.0          # an MCCL all-reduce's last sends take milliseconds


def marks_folder() -> str | None:
    """The launcher's folder for finished workers' marks, in a worker that mindspeed.msrun started."""
    folder = os.environ.get(LAUNCHER_ENV)
    return folder if folder and os.environ.get("MS_ROLE") == "MS_WORKER" else None


def finish(code: int) -> int:
    """Every worker calls this at its end with its exit code. Returns `code` (for
    `sys.exit(finish(...))`) unless mindspeed.msrun launched the job and every rank's code is 0:
    then the process ends here, skipping the exit handlers."""
    folder = marks_folder()
    if folder is None:
        return code
    agreed = _failures_in_world(float(code != 0))
    if agreed is None or agreed[0]:
        return code
    grace = agreed[1]
    with open(os.path.join(folder, f"{os.getpid()}.done"), "w"):
        pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):       # closed by the program
            pass
    time.sleep(grace)
    os._exit(0)


def _failures_in_world(failed: float) -> tuple[float, float] | None:
    """(how many ranks failed, the seconds to wait before leaving) by one all-reduce; None where
    this process never joined the world (it failed before)."""
    from mindspore.communication import GlobalComm
    if not GlobalComm.INITED:
        return None
    from mindspeed.backends.mindspore.comm import shared_memory_world  # imports MindSpore (exit path)
    world = shared_memory_world()
    if world is not None:
        return float(world.all_reduce_sum(np.array([failed], np.float32))[0]), 0.0
    import mindspore as ms
    from mindspore import ops
    try:
        total = ops.AllReduce(ops.ReduceOp.SUM, GlobalComm.WORLD_COMM_GROUP)(ms.Tensor(np.array([failed], np.float32)))
        return float(total.asnumpy()[0]), MCCL_GRACE_S
    except RuntimeError:        # a peer later than MCCL's receive timeout: no agreement, the normal exit
        return None
