"""train_distributed_ms.sh end to end: msrun -> pretrain_gpt.py --backend mindspore on 2 processes
(TP=2) with a tiny GPT on a tiny dataset: the loss falls, a checkpoint is written, and resuming
from the middle checkpoint reproduces the uninterrupted run's losses; a checkpoint cut short is
refused by every worker with one line; the checkpoint crosses to the torch trainer's launch script
and back without losing a bit. Also: MAX_RESTARTS brings a job whose worker was killed back from its
last checkpoint, and two launches on this machine train as two nodes."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from mindspeed.net import free_port
from tests_extend.system.disk_full import run_filling_after_first_save, small_tmpfs
from tests_extend.system.file_snapshot import snapshot
from tests_extend.system.throughput_lines import assert_tflops_and_mfu
from tests_extend.system.interrupted_run import loss_lines, run_interrupted, sigterm_everyone
from tests_extend.system.killed_save import assert_killed_in_the_save_of_8, assert_redid_5_to_8, kill_inside_save

pytest.importorskip("mindspore")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests_extend", "example", "train_distributed_ms.sh")
TORCH_SCRIPT = os.path.join(ROOT, "tests_extend", "example", "train_distributed.sh")
TINY = dict(NUM_LAYERS="1", HIDDEN_SIZE="32", NUM_HEADS="4", SEQ_LENGTH="32", MICRO_BATCH="4",
            GLOBAL_BATCH="4", TRAIN_ITERS="8", LR="1e-2", MIN_LR="1e-3", WARMUP_ITERS="1",
            LOG_INTERVAL="2", EVAL_INTERVAL="100", EVAL_ITERS="1", SPLIT="90,10,0")


def _free_port():
    return str(free_port())


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    rng = random.Random(1)
    words = ["to be", "or not", "the king", "a horse", "my lord", "is here"]
    root = tmp_path_factory.mktemp("msdata")
    texts = []
    for i in range(10):
        path = root / f"part{i}.txt"
        path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(4)) + "." for _ in range(80)) + "\n")
        texts.append(str(path))
    prefix = str(root / "tiny")
    r = subprocess.run([sys.executable, "-m", "mindspeed.data", "--input", *texts, "--output-prefix", prefix],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    return prefix


def launch(tmp_path, name, extra_env, args=(), timeout=420, script=SCRIPT):
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=_free_port(), LOG_DIR=str(tmp_path / f"{name}_logs"))
    env.update(TINY)
    env.update(extra_env)      # the case's own settings win over TINY's
    return subprocess.run(["bash", script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_script(tmp_path, name, extra_env, args=(), timeout=420, script=SCRIPT):
    loss_file = tmp_path / f"{name}.jsonl"
    r = launch(tmp_path, name, extra_env, ["--log-loss-file", str(loss_file), *args], timeout, script)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    losses = {}
    for line in loss_file.read_text().splitlines():
        rec = json.loads(line)
        losses[rec["iteration"]] = rec["lm_loss"]
    return r.stdout, losses


def run_two_nodes(tmp_path, name, extra_env, args=()):
    """Two launches of the script acting as two nodes, meeting at 127.0.0.1:MASTER_PORT: (node 0's
    output, the losses)."""
    loss_file = tmp_path / f"{name}.jsonl"
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=_free_port(), MASTER_ADDR="127.0.0.1", NNODES="2",
               NPUS_PER_NODE="1", CLUSTER_TIMEOUT="120", **TINY)
    env.update(extra_env)
    nodes = [subprocess.Popen(["bash", SCRIPT, "--log-loss-file", str(loss_file), *args], cwd=ROOT,
                              env=dict(env, NODE_RANK=str(rank), LOG_DIR=str(tmp_path / f"{name}_node{rank}")),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=420)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    for rank in (0, 1):        # one worker per node, ranks in node order
        logs = os.listdir(tmp_path / f"{name}_node{rank}")
        assert f"worker_{rank}.log" in logs and f"worker_{1 - rank}.log" not in logs, (rank, logs)
    losses = {rec["iteration"]: rec["lm_loss"] for rec in map(json.loads, loss_file.read_text().splitlines())}
    return outputs[0], losses


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_dataset):
    """8 iterations on 2 msrun workers (TP=2), checkpoints at 4 and 8, self-healing: MAX_RESTARTS=1
    (msrun has no restart option; the script relaunches) and worker 1 killed (SIGKILL) once iteration 5
    is logged, so the job comes back by itself from the step-4 checkpoint (LOAD_DIR defaults to
    CKPT_DIR). The restart does not wait for MindSpore's scheduler to miss the dead worker's
    heartbeats: with MS_NODE_TIMEOUT at 10 minutes (past the wait below) the launcher,
    mindspeed.msrun, stops the scheduler at once and says in one line which worker failed."""
    tmp_path = tmp_path_factory.mktemp("full")
    ckpt, loss_file, log = tmp_path / "ckpt", tmp_path / "full.jsonl", tmp_path / "job.log"
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=_free_port(), DATA_PATH=tiny_dataset,
               LOG_DIR=str(tmp_path / "logs"), CKPT_DIR=str(ckpt), SAVE_INTERVAL="4", MAX_RESTARTS="1",
               MS_NODE_TIMEOUT="600", **TINY)
    rc, output, _ = run_interrupted(
        ["bash", SCRIPT, "--op-cal-tflops", "--npu-deterministic", "--log-loss-file", str(loss_file)], log,
        loss_lines(loss_file, 5), lambda job: os.kill(_msrun_worker(job, 1), signal.SIGKILL), 300,
        cwd=ROOT, env=env)
    assert rc == 0, output[-4000:]
    records = [json.loads(line) for line in loss_file.read_text().splitlines()]
    return ckpt, output, records


def _msrun_worker(launcher: int, rank: int) -> int:
    """The pid of msrun's worker `rank` among the launch script's descendants."""
    parents, envs = {}, {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                envs[int(entry)] = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError, IndexError):
            continue          # gone meanwhile, or not readable
    family, grown = {launcher}, True
    while grown:
        more = {pid for pid, parent in parents.items() if parent in family} - family
        family |= more
        grown = bool(more)
    for pid in family:
        env = envs.get(pid, {})
        if env.get(b"MS_ROLE") == b"MS_WORKER" and env.get(b"RANK_ID") == str(rank).encode():
            return pid
    raise AssertionError(f"no msrun worker {rank} under {launcher}")


def test_a_killed_worker_brings_the_job_back_from_the_last_checkpoint(full_run):
    """The run above: the first attempt got past iteration 5, the restart redid 5-8 from the step-4
    checkpoint, and the redone iterations repeat the first attempt's losses bit for bit."""
    ckpt, output, records = full_run
    iterations = [r["iteration"] for r in records]
    restart = next(i for i in range(1, len(iterations)) if iterations[i] <= iterations[i - 1])
    first, second = records[:restart], records[restart:]
    assert first[-1]["iteration"] >= 5 and [r["iteration"] for r in second] == [5, 6, 7, 8], iterations
    before = {r["iteration"]: r["lm_loss"] for r in first}
    assert all(r["lm_loss"] == before[r["iteration"]] for r in second if r["iteration"] in before), records
    assert "> msrun exited with code 1: restart 1 of 1, from the last checkpoint" in output, output[-3000:]
    assert (f"msrun: worker rank 1 was killed by SIGKILL (its own error line, if any, is in "
            f"{ckpt.parent / 'logs' / 'worker_1.log'}); the job's other workers and its scheduler were stopped\n"
            "> msrun exited with code 1") in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "no checkpoint yet in this --save directory; starting from iteration 0" in output   # the first start
    assert f"loaded checkpoint {ckpt / 'iter_0000004'} at iteration 4" in output, output[-3000:]  # the restart


def test_sigterm_to_the_whole_job_saves_the_iteration_and_the_resumed_run_repeats_the_losses(
        tmp_path, tiny_dataset, full_run):
    """--exit-signal-handler: SIGTERM to msrun's process group and every worker, as a cluster scheduler
    sends it. Each worker finishes its step, saves that iteration and exits without a traceback (msrun
    has no handler: the signal ends it); resuming repeats the uninterrupted run's losses bit for bit."""
    ckpt, losses, log = tmp_path / "ckpt", tmp_path / "losses.jsonl", tmp_path / "job.log"
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=_free_port(), DATA_PATH=tiny_dataset,
               LOG_DIR=str(tmp_path / "logs"), CKPT_DIR=str(ckpt), **TINY)
    _rc, _output, workers = run_interrupted(
        ["bash", SCRIPT, "--npu-deterministic", "--exit-signal-handler", "--log-loss-file", str(losses)], log,
        loss_lines(losses, 2), lambda job: sigterm_everyone(job, [_msrun_worker(job, rank) for rank in (0, 1)]),
        300, cwd=ROOT, env=env)   # msrun has no handler: the signal ends it
    _wait_gone(workers, timeout=300)
    stops = set()
    for rank in (0, 1):
        worker_log = (tmp_path / "logs" / f"worker_{rank}.log").read_text()
        assert "Traceback" not in worker_log and "error:" not in worker_log, worker_log[-3000:]
        stops.update(re.findall(r"> exiting at iteration (\d+): received SIGTERM", worker_log))
    assert len(stops) == 1, stops                # rank 0 logs it (once)
    at = int(stops.pop())
    assert 2 <= at < 8 and (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(at)

    full = {r["iteration"]: r["lm_loss"] for r in full_run[2]}
    _out, resumed = run_script(tmp_path, "resumed", dict(DATA_PATH=tiny_dataset, LOAD_DIR=str(ckpt)),
                               ["--npu-deterministic"])
    assert sorted(resumed) == list(range(at + 1, 9))
    before = {json.loads(line)["iteration"]: json.loads(line)["lm_loss"] for line in losses.read_text().splitlines()}
    assert all(before[it] == full[it] for it in before) and all(resumed[it] == full[it] for it in resumed)


def test_a_full_disk_during_a_save_stops_the_run_in_one_line_and_keeps_the_last_checkpoint(tmp_path, tiny_dataset):
    """One process: a 4 MB tmpfs as --save, filled once the iteration-10 checkpoint is written, so the
    iteration-20 save fails: one line naming the cause, the tracker still names 10, and 10 loads."""
    pretrain = os.path.join(ROOT, "tests_extend", "example", "pretrain_gpt.py")
    args = [sys.executable, pretrain, "--backend", "mindspore", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "4",
            "--data-path", tiny_dataset, "--eval-iters", "0", "--split", "90,10,0"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    with small_tmpfs(tmp_path / "disk", 4) as disk:
        ckpt = disk / "ckpt"
        rc, _output, error = run_filling_after_first_save(
            [*args, "--train-iters", "40", "--save", str(ckpt), "--save-interval", "10", "--exit-interval", "30"],
            disk, ckpt, tmp_path / "run.log", 300, cwd=ROOT, env=env)
        assert rc == 2 and str(ckpt) in error and "No space left on device" in error, error   # iteration 20
        loaded = subprocess.run([*args, "--load", str(ckpt), "--train-iters", "11"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=300)
        assert loaded.returncode == 0 and f"at iteration 10" in loaded.stdout, loaded.stdout[-3000:] + loaded.stderr[-2000:]


def test_kill_9_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path, tiny_dataset):
    """One process, --save X --load X: SIGKILL while it writes the iteration-8 checkpoint (paused
    inside the real save, after the safetensors files and before meta.json: killed_save). The tracker
    still names 4 and the half-written save is in iter_0000008.partial; the same command again
    resumes from 4, redoes 5-8 with the killed run's losses bit for bit and completes 8. A save of
    the tracked iteration 8 again (--ckpt-step 4), killed the same way, leaves it byte for byte."""
    ckpt, losses = tmp_path / "ckpt", tmp_path / "losses.jsonl"
    command = [sys.executable, os.path.join(ROOT, "tests_extend", "example", "pretrain_gpt.py"), "--backend",
               "mindspore", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
               "32", "--micro-batch-size", "4", "--global-batch-size", "4", "--data-path", tiny_dataset,
               "--eval-iters", "0", "--split", "90,10,0", "--train-iters", "8", "--save", str(ckpt), "--load",
               str(ckpt), "--save-interval", "4", "--npu-deterministic", "--log-loss-file", str(losses)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    kill_inside_save(command, env, "open:iter_0000008", tmp_path / "paused", tmp_path / "killed.log", 300, cwd=ROOT)
    killed = assert_killed_in_the_save_of_8(ckpt, losses, "model.safetensors")

    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = again.stdout + again.stderr
    assert again.returncode == 0 and "Traceback" not in output, output[-3000:]
    assert f"loaded checkpoint {ckpt / 'iter_0000004'} at iteration 4" in output, output[-3000:]
    assert_redid_5_to_8(ckpt, losses, killed)

    before = snapshot(ckpt / "iter_0000008")
    kill_inside_save([*command, "--ckpt-step", "4"], env, "open:iter_0000008", tmp_path / "paused_again",
                     tmp_path / "killed_again.log", 300, cwd=ROOT)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert snapshot(ckpt / "iter_0000008") == before


def test_a_rank_that_hangs_in_a_collective_stops_the_others_within_the_timeout(tmp_path, tiny_dataset):
    """TP=2 with --distributed-timeout-minutes 0.2 (12 s): worker 1 stopped with SIGSTOP once
    iteration 2 is logged (alive, it never joins another shared-memory collective). Worker 0 exits
    within the timeout (plus the load's slack) with one line naming the collective, its ranks, the
    flag and rank 1, no traceback; the launcher (mindspeed.msrun) then stops the stopped worker and
    the scheduler, and the whole job ends by itself in one line."""
    losses = tmp_path / "losses.jsonl"
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=_free_port(), DATA_PATH=tiny_dataset,
               LOG_DIR=str(tmp_path / "logs"), **dict(TINY, TRAIN_ITERS="200"))
    env.pop("MINDSPEED_MS_SHM_TIMEOUT", None)       # the override would win over the flag

    def stop_worker_1(job):
        os.kill(_msrun_worker(job, 1), signal.SIGSTOP)
        return time.monotonic()

    # 12 s, not less: the timeout holds from the first collective, and before the first loss line a rank
    # can trail the other by seconds while both trace their graphs (4.8 s was exceeded at load 19)
    rc, output, stopped = run_interrupted(["bash", SCRIPT, "--distributed-timeout-minutes", "0.2",
                                           "--log-loss-file", str(losses)], tmp_path / "job.log",
                                          loss_lines(losses, 1), stop_worker_1, 300, cwd=ROOT, env=env)
    took = time.monotonic() - stopped
    log = (tmp_path / "logs" / "worker_0.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert re.fullmatch(r"error: rank 0: shared-memory \w+ over ranks \[0, 1\] timed out after 12 s "
                        r"\(--distributed-timeout-minutes 0\.2\): rank 1 never joined it .*", errors[0]), errors
    assert rc == 1 and output.strip().splitlines()[-1].startswith("msrun: worker rank 0 exited with code 1"), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert took < 12 + 20, f"the job ran {took:.0f} s after worker 1 stopped"


def test_the_timeout_flag_is_refused_where_a_group_runs_mccl(tmp_path, tiny_dataset):
    """MINDSPEED_MS_SHM_COLLECTIVES=0 leaves the TP group to MindSpore's CPU collectives (MCCL),
    which take no timeout: --distributed-timeout-minutes stops both workers with one line before
    any training (the flag is not silently dropped)."""
    r = launch(tmp_path, "mccl", dict(DATA_PATH=tiny_dataset, MINDSPEED_MS_SHM_COLLECTIVES="0", CLUSTER_TIMEOUT="120"),
               ["--distributed-timeout-minutes", "0.5"])
    assert r.returncode != 0
    for rank in (0, 1):
        log = (tmp_path / "mccl_logs" / f"worker_{rank}.log").read_text()
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in log and "lm loss" not in log, log[-3000:]
        assert errors[0].startswith("error: --distributed-timeout-minutes 0.5: the group of ranks [0, 1] runs "
                                    "MindSpore 2.10's CPU collectives (MCCL"), errors[0]


def _wait_gone(pids, timeout):
    deadline = time.time() + timeout
    while any(os.path.exists(f"/proc/{pid}") and not _zombie(pid) for pid in pids):
        assert time.time() < deadline, f"workers {pids} still running {timeout} s after SIGTERM"
        time.sleep(0.1)


def _zombie(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_train_save_and_resume(tmp_path, tiny_dataset, full_run):
    """Also: with the step-8 model file cut short, a resume stops both workers with the same single
    line naming the file and iteration 4 with its flag, changes nothing, and that flag resumes."""
    ckpt, out, records = full_run
    full = {r["iteration"]: r["lm_loss"] for r in records}
    assert "iteration        8/       8" in out and "lm loss:" in out and "validation loss" in out
    logged = sum(r["iteration"] % int(TINY["LOG_INTERVAL"]) == 0 for r in records)
    assert_tflops_and_mfu(out, TINY, logged, "fp32 matmul with mindspore")
    assert sorted(full) == list(range(1, 9))
    assert full[7] + full[8] < full[1] + full[2] - 0.2          # it learns
    for it in (4, 8):
        assert (ckpt / f"iter_{it:07d}" / "model.safetensors").is_file()
    assert oct(os.stat(ckpt / "iter_0000004" / "model.safetensors").st_mode & 0o777) == "0o640"

    model_file = ckpt / "iter_0000008" / "model.safetensors"
    os.truncate(model_file, 100)
    before = snapshot(ckpt)
    r = launch(tmp_path, "truncated", dict(DATA_PATH=tiny_dataset, LOAD_DIR=str(ckpt), CLUSTER_TIMEOUT="120"))
    assert r.returncode != 0                                   # msrun: a worker exited with code 2
    lines = []
    for rank in (0, 1):
        log = (tmp_path / "truncated_logs" / f"worker_{rank}.log").read_text()
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
        lines.append(errors[0])
    assert lines[0] == lines[1], lines
    assert f"{model_file} is truncated (100 bytes" in lines[0], lines[0]
    assert f"the last readable checkpoint is iteration 4: load it with --load {ckpt} --ckpt-step 4" in lines[0]
    assert snapshot(ckpt) == before                           # tracker and checkpoints untouched

    # multi-node: the resume runs as two nodes on this machine (NNODES=2, NODE_RANK 0 and 1, one msrun
    # worker each, TP=2 across them) and repeats the single-node 2-process run's steps
    out, resumed = run_two_nodes(tmp_path, "resumed", dict(DATA_PATH=tiny_dataset, LOAD_DIR=str(ckpt)),
                                 ["--ckpt-step", "4", "--npu-deterministic"])
    assert "TFLOP/s" not in out and "MFU" not in out                 # the flag off: no such fields
    assert f"loaded checkpoint {ckpt / 'iter_0000004'} at iteration 4" in out
    assert sorted(resumed) == [5, 6, 7, 8]
    for it in resumed:       # --npu-deterministic: the resumed steps repeat the uninterrupted ones bit for bit
        assert resumed[it] == full[it]
    assert snapshot(ckpt) == before


def test_checkpoint_crosses_to_torch_and_back_bit_for_bit(tmp_path, tiny_dataset, full_run):
    """MindSpore's step-4 checkpoint -> the torch launch script loads it (weights, Adam moments and
    step, iteration, samples) and saves it again as torch_dist -> the MindSpore script resumes from
    that and repeats the uninterrupted run's steps 5-8 bit for bit (same TP=2 on both sides, so the
    padded vocabulary is the same model)."""
    ms_ckpt, _, records = full_run
    full = {r["iteration"]: r["lm_loss"] for r in records}
    torch_ckpt = tmp_path / "torch_ckpt"
    out = launch(tmp_path, "torch", dict(DATA_PATH=tiny_dataset, LOAD_DIR=str(ms_ckpt), CKPT_DIR=str(torch_ckpt),
                                          TRAIN_ITERS="4", EVAL_ITERS="0"), ["--ckpt-step", "4"], script=TORCH_SCRIPT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"loaded checkpoint {ms_ckpt} at iteration 4" in out.stdout
    assert (torch_ckpt / "iter_0000004" / ".metadata").is_file()            # torch_dist, not a copy
    assert not (torch_ckpt / "iter_0000004" / "model.safetensors").exists()
    out, resumed = run_script(tmp_path, "back", dict(DATA_PATH=tiny_dataset, LOAD_DIR=str(torch_ckpt)),
                              ["--npu-deterministic"])
    assert f"loaded checkpoint {torch_ckpt / 'iter_0000004'} at iteration 4" in out
    assert sorted(resumed) == [5, 6, 7, 8]
    for it in resumed:
        assert resumed[it] == full[it], (it, resumed[it], full[it])
