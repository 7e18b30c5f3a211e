"""A training job interrupted on purpose, as a scheduler, a crash or a full disk would: started in a
session of its own with its output in a log, something done to it once it is far enough, then waited
for. Whatever still runs at the end is killed with its process group and its descendants' groups
(launchers start workers in sessions of their own): a hang fails the test and leaves no process behind."""
import os
import signal
import subprocess
import time


def loss_lines(path, count: int):
    """A `ready` test: the job's --log-loss-file `path` has `count` lines (iterations) or more."""
    return lambda: path.exists() and path.read_text().count("\n") >= count


# how often `ready` is asked: the tiny jobs run an iteration in 10-30 ms, and a 50 ms poll let one run
# 6 iterations past its trigger, to its end, before the test's SIGTERM came (a clean-clone CI run)
POLL_S = 0.005


def run_interrupted(argv, log, ready, act, timeout, **popen) -> tuple[int, str, object]:
    """Start `argv` (its output to the file `log`); as soon as `ready()` holds, call `act(pid)` with
    the job's pid, which leads its process group; wait for the job to end. Returns (exit code, output,
    what `act` returned). `timeout` bounds each of the two waits."""
    with open(log, "w") as out:
        job = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen)
    try:
        deadline = time.time() + timeout
        while not ready():
            assert job.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(POLL_S)
        acted = act(job.pid)
        try:
            job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {timeout} s after it was interrupted: "
                                 f"{log.read_text()[-3000:]}") from None
    finally:
        if job.poll() is None:
            kill_everyone(job.pid, descendants(job.pid))   # workers have sessions of their own
            job.wait()
    return job.returncode, log.read_text(), acted


def descendants(pid: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue          # gone meanwhile, or not a process
    family, grown = {pid}, True
    while grown:
        more = {child for child, parent in parents.items() if parent in family} - family
        family |= more
        grown = bool(more)
    return sorted(family - {pid})


def sigterm_everyone(launcher: int, workers) -> list[int]:
    """SIGTERM as a cluster scheduler sends it: to the launcher's process group and to each of the
    `workers` (launchers start them in sessions of their own). Returns the workers' pids."""
    workers = list(workers)
    os.killpg(launcher, signal.SIGTERM)
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    return workers


def kill_everyone(launcher: int, workers=()) -> list[int]:
    """SIGKILL, as a node that loses power or the OOM killer leaves a job: the launcher's process
    group and each of the `workers`' (launchers start them in sessions of their own) with whatever
    they forked, a checkpoint writer among them. Returns the workers' pids."""
    workers = list(workers)
    for group in (launcher, *workers):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:       # gone with the launcher's group
            pass
    return workers
