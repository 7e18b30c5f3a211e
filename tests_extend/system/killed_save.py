"""A job killed (SIGKILL) inside a checkpoint save, deterministically: with fault_injection/pause_in_save
first on PYTHONPATH, the first of its processes to do `at` (`<audit event>:<text of the path>`)
pauses there, inside the real save, and the test kills every process of the job at that moment.
Both trainers' kill-during-save tests share it."""
import json
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


def _records(losses) -> list[dict]:
    return [json.loads(line) for line in losses.read_text().splitlines()]


def assert_killed_in_the_save_of_8(ckpt, losses, written: str) -> dict:
    """After a kill inside the iteration-8 save of a run saving every 4: the tracker names 4, the
    save is in iter_0000008.partial (with the file `written` already) and no iter_0000008 exists.
    Returns the killed run's losses by iteration (1-8)."""
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert not (ckpt / "iter_0000008").exists()
    assert written in os.listdir(ckpt / "iter_0000008.partial")
    killed = {r["iteration"]: r["lm_loss"] for r in _records(losses)}
    assert sorted(killed) == list(range(1, 9)), killed
    return killed


def assert_redid_5_to_8(ckpt, losses, killed: dict) -> None:
    """After the same command again: it redid iterations 5-8 with the killed run's losses bit for
    bit, and iteration 8 is tracked and complete."""
    records = _records(losses)
    assert [r["iteration"] for r in records[8:]] == [5, 6, 7, 8]
    assert all(r["lm_loss"] == killed[r["iteration"]] for r in records[8:]), (records, killed)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert not (ckpt / "iter_0000008.partial").exists()
