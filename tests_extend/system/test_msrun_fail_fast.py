"""`python -m mindspeed.msrun` (what train_distributed_ms.sh launches with): a worker that dies ends
the job at once, in one line naming it, instead of after the scheduler has missed its heartbeats for
MS_NODE_TIMEOUT (set to 10 minutes here, past the test's own limit); a job whose workers succeed
ends with 0 as under msrun."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("mindspore")

from mindspeed.net import free_port  # noqa: E402
from tests_extend.system.interrupted_run import descendants, kill_everyone  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "msrun_exit_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _msrun(tmp_path, *job_args):
    env = dict(os.environ, MS_NODE_TIMEOUT="600", GLOG_v="3",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    job = subprocess.Popen([sys.executable, "-m", "mindspeed.msrun", "--worker_num=2", "--local_worker_num=2",
                            f"--master_port={free_port()}", f"--log_dir={tmp_path / 'logs'}", "--join=True",
                            WORKER, *job_args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        out, err = job.communicate(timeout=240)
    finally:       # a job still running (the scheduler waiting, a worker asleep) leaves nothing behind
        if job.poll() is None:
            kill_everyone(job.pid, descendants(job.pid))
            job.wait()
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


def test_a_killed_worker_ends_the_job_at_once_in_one_line(tmp_path):
    result = _msrun(tmp_path, "die")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"msrun: worker rank 1 was killed by SIGKILL (its own error line, if any, is in "
                    f"{tmp_path / 'logs' / 'worker_1.log'}); the job's other workers and its scheduler were stopped")
    assert "Traceback" not in result.stderr + result.stdout


def test_a_job_whose_workers_succeed_ends_with_0(tmp_path):
    result = _msrun(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "msrun:" not in result.stderr
