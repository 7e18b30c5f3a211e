"""A job killed (SIGKILL) inside a checkpoint save, deterministically: with fault_injection/pause_in_save
first on PYTHONPATH, the first of its processes to do `at` (`<audit event>:<text of the path>`)
pauses there, inside the real save, and the test kills every process of the job at that moment.
Both trainers' kill-during-save tests share it."""
import os

from tests_extend.system.interrupted_run import kill_everyone, run_interrupted

PAUSE_IN_SAVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_injection", "pause_in_save")


def kill_inside_save(argv, env, at: str, mark, log, timeout, workers=lambda job: (), **popen) -> str:
    """Run `argv` until a process pauses at `at` (it writes its pid to the file `mark`), then SIGKILL
    the launcher's process group and each of `workers(job)`'s. Returns the job's output."""
    env = dict(env, MINDSPEED_TEST_PAUSE_AT=at, MINDSPEED_TEST_PAUSED=str(mark),
               PYTHONPATH=os.pathsep.join(filter(None, [PAUSE_IN_SAVE, env.get("PYTHONPATH")])))
    rc, output, _ = run_interrupted(argv, log, mark.exists, lambda job: kill_everyone(job, workers(job)), timeout,
                                    env=env, **popen)
    assert rc == -9, output[-3000:]          # killed, not finished
    return output
