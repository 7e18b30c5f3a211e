"""`python -m mindspeed.msrun ...`: MindSpore's msrun (`mindspore.parallel.cluster.run`, the same
arguments) whose failed worker stops the job at once and ends it in one line.

When a worker exits with an error, msrun kills the other workers and then waits for the job's
scheduler, which only gives up once it has missed the dead workers' heartbeats for
MS_NODE_TIMEOUT seconds (30 by default): every failed job, and so every self-healing restart,
took that long to end. Here msrun stops the scheduler together with the workers it kills on that
path, and its closing traceback ("Distributed job exited with exception") becomes one line naming
the worker that failed first.

Once every worker of this node has exited 0 after agreeing with all ranks of the job that each
succeeded (each leaves a mark in a folder this launcher passes them in worker_exit.LAUNCHER_ENV),
the job has succeeded: the launcher holding the scheduler (node 0's), whose only work was
coordinating them, stops it instead of waiting for it. So a MindSpeed worker whose work succeeded
leaves without MindSpore's exit handler, which now and then crashes a finished process
(docs/native-crash.md); the scheduler would wait for such a worker's goodbye until MS_NODE_TIMEOUT.
Every node of a job must be launched this way (the launch scripts do). Everything else is msrun's
own behaviour.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile

from mindspore.parallel.cluster.process_entity._api import _ProcessManager
from mindspore.parallel.cluster.run import get_args

from mindspeed.backends.mindspore.worker_exit import LAUNCHER_ENV

JOB_FAILED = "Distributed job exited with exception"


class FailFastProcessManager(_ProcessManager):
    """msrun's process manager; once joining finds a failed worker, the scheduler is stopped with
    the other workers. Only there: msrun's other callers of kill_worker_processes (its process-level
    restarts) keep their scheduler."""

    _joining = False
    first_failure = None        # (rank, exit code, log file) of the first failed worker seen
    marks = None                # the folder where workers that agreed the job succeeded leave a mark

    def join_processes(self):
        self._joining = True
        return super().join_processes()

    def kill_tail_log_processes(self):
        """msrun calls this once the workers are done, before waiting for the scheduler."""
        super().kill_tail_log_processes()
        if self._joining and self.marks is not None and self._all_agreed():
            self._end_scheduler()

    def _all_agreed(self) -> bool:
        """Every local worker exited 0 after agreeing with all ranks (worker_exit.finish)."""
        done = [name for name in os.listdir(self.marks) if name.endswith(".done")]
        return all(p.poll() == 0 for p in self.cgn_processes) and len(done) == len(self.cgn_processes)

    def _end_scheduler(self):
        scheduler = self.msn_process
        if scheduler is None:
            return
        if scheduler.poll() is None:
            scheduler.kill()
            scheduler.wait()
        self.msn_process = None       # msrun then judges the job by its workers alone

    def kill_worker_processes(self):
        if self._joining and self.first_failure is None:
            self.first_failure = self._failed_worker()
        super().kill_worker_processes()
        scheduler = self.msn_process
        if self._joining and scheduler is not None and scheduler.poll() is None:
            scheduler.kill()

    def _failed_worker(self):
        for index, process in enumerate(self.cgn_processes):
            code = process.poll()
            if code:
                rank, log = self._get_node_id_and_log_path(index)
                return rank, code, log
        return None


def describe(failure) -> str:
    if failure is None:
        return "msrun: the job failed; the workers and the scheduler were stopped (logs in msrun's --log_dir)"
    rank, code, log = failure
    how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
    return (f"msrun: worker rank {rank} {how} (its own error line, if any, is in {log}); the job's other "
            "workers and its scheduler were stopped")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def main(argv: list[str] | None = None) -> int:
    sys.argv = ["msrun", *(sys.argv[1:] if argv is None else argv)]
    manager = FailFastProcessManager(get_args())
    if manager.node_rank > 0:
        # node 0 holds the scheduler: msrun would start a second one (its port taken) on every
        # other node that shares the master's machine
        manager.is_master = False
    if not manager.is_simulation:
        manager.marks = tempfile.mkdtemp(prefix="mindspeed-msrun-")
        os.environ[LAUNCHER_ENV] = manager.marks      # inherited by the workers msrun starts
    try:
        manager.run()
    except RuntimeError as err:
        if JOB_FAILED not in str(err):
            raise
        print(describe(manager.first_failure), file=sys.stderr)
        return 1
    finally:
        if manager.marks is not None:
            shutil.rmtree(manager.marks, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
