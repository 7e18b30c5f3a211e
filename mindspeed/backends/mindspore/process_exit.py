"""End a MindSpore process after its exit handlers, without Python's teardown.

MindSpore 2.10 registers its own cleanup as an exit handler when it is imported (the cluster node's
finalize that msrun's scheduler waits for, the runtime and devices released). Python's teardown
runs after the handlers and frees the tensors, cells and graphs that modules still hold; their
destructors can then use runtime state the cleanup already freed. A process whose work was done
dies of "std::system_error: Invalid argument" (a freed mutex), SIGSEGV or glibc heap corruption,
and msrun reports the job failed (docs/native-crash.md). The entry points that run MindSpore end
through `exit_after_cleanup` instead: every exit handler runs, then the process ends."""
from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_after_cleanup(status: int) -> NoReturn:
    """Run the exit handlers (MindSpore's cleanup, logging's flush) and end with `status`."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    atexit._run_exitfuncs()      # what Python's own exit runs first, before its teardown
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)

