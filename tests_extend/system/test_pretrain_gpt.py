"""The example end to end: train_distributed.sh -> torchrun -> pretrain_gpt.py on 2 processes,
with a tiny GPT and a tiny dataset (shortened run). Every launch has a timeout, so a hang fails."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from mindspeed.net import free_port
from tests_extend.system.disk_full import run_filling_after_first_save, small_tmpfs
from tests_extend.system.file_snapshot import snapshot
from tests_extend.system.throughput_lines import assert_tflops_and_mfu
from tests_extend.system.interrupted_run import loss_lines, run_interrupted, sigterm_everyone
from tests_extend.system.tiny_corpus import build_indexed_corpus
from tests_extend.system.killed_save import assert_killed_in_the_save_of_8, assert_redid_5_to_8, kill_inside_save

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests_extend", "example", "train_distributed.sh")
PRETRAIN = os.path.join(ROOT, "tests_extend", "example", "pretrain_gpt.py")
LAUNCH_TIMEOUT = 240

TINY = dict(NUM_LAYERS="2", HIDDEN_SIZE="64", NUM_HEADS="4", SEQ_LENGTH="32", MICRO_BATCH="4",
            GLOBAL_BATCH="8", TRAIN_ITERS="12", LR="1e-2", MIN_LR="1e-3", WARMUP_ITERS="1",
            LOG_INTERVAL="1", EVAL_INTERVAL="6", EVAL_ITERS="2", SPLIT="90,10,0")


def _free_port():
    return str(free_port())


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    """~60k characters of simple, learnable text -> char-level indexed dataset."""
    rng = random.Random(0)
    subjects, verbs, objects = ["the king", "a fool", "my lord", "the queen"], ["loves", "fears", "sees"], \
        ["the crown", "his horse", "the sea", "a ghost"]
    lines = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(2500)]
    # 20 documents so the 90/10 split has whole validation documents
    return build_indexed_corpus(tmp_path_factory.mktemp("data"), [lines[i * 125:(i + 1) * 125] for i in range(20)])


def launch_example(env_overrides, args=(), timeout=LAUNCH_TIMEOUT) -> subprocess.CompletedProcess:
    """train_distributed.sh with the tiny model; env_overrides win (PYTHON included)."""
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=_free_port(), **TINY)
    env.update(env_overrides)
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_example(env_overrides, args=(), timeout=LAUNCH_TIMEOUT):
    result = launch_example(env_overrides, args, timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


def read_losses(path):
    with open(path) as f:
        return {rec["iteration"]: rec["lm_loss"] for rec in map(json.loads, f)}


def assert_learns(losses, output):
    first = sum(losses[i] for i in (1, 2, 3)) / 3
    last = sum(losses[i] for i in (10, 11, 12)) / 3
    assert last < first - 0.3, f"loss did not decrease: first {first:.3f}, last {last:.3f}"
    assert "final validation loss at iteration 12" in output
    assert "iteration       12/      12 |" in output and "lm loss:" in output and "grad norm:" in output


TP2_SP = "tensor-parallel-2 + sequence-parallel"


# Megatron-LM's legacy checkpoint (per-rank files), saved by the TP=2 + SP run at iterations 6 and 12
LEGACY = ["--sequence-parallel", "--ckpt-format", "torch", "--save-interval", "6"]


@pytest.fixture(scope="module")
def tp2_sp_single_node(tiny_dataset, tmp_path_factory):
    """The TP=2 + SP run on one node (2 processes): also the multi-node test's reference; it saves
    --ckpt-format torch checkpoints (reading its weights changes nothing it computes). (output, losses,
    checkpoint root)."""
    tmp = tmp_path_factory.mktemp("tp2sp")
    loss_file, ckpt = str(tmp / "losses.jsonl"), tmp / "ckpt"
    output = run_example(dict(TP="2", PP="1", DATA_PATH=tiny_dataset), [*LEGACY, "--save", str(ckpt),
                                                                         "--log-loss-file", loss_file])
    return output, read_losses(loss_file), ckpt


# the memory savers together on a pipeline (--reuse-fp32-param excludes --swap-optimizer: the DP run has it)
MEMORY_SAVERS = ["--recompute-activation-function", "--recompute-norm", "--swap-attention", "--swap-optimizer"]


@pytest.mark.parametrize("name, env, extra", [
    (TP2_SP, dict(TP="2", PP="1"), ["--sequence-parallel"]),
    ("pipeline-parallel-2 + tensorboard + op-cal-tflops + memory savers", dict(TP="1", PP="2"),
     ["--tensorboard-dir", "{tmp}/tb", "--op-cal-tflops", *MEMORY_SAVERS]),
    ("data-parallel-2 + distributed optimizer + bf16 reuse-fp32-param", dict(TP="1", PP="1"),
     ["--use-distributed-optimizer", "--bf16", "--reuse-fp32-param"]),
])
def test_example_trains_on_two_processes(tiny_dataset, tmp_path, name, env, extra, request):
    loss_file = str(tmp_path / "losses.jsonl")
    extra = [arg.format(tmp=tmp_path) for arg in extra]
    if name == TP2_SP:
        output, losses, _ = request.getfixturevalue("tp2_sp_single_node")
    else:
        output = run_example(dict(env, DATA_PATH=tiny_dataset), [*extra, "--log-loss-file", loss_file])
        losses = read_losses(loss_file)
    tp, pp = env["TP"], env["PP"]
    assert f"TP {tp} x PP {pp} x CP 1 x DP {2 // (int(tp) * int(pp))}" in output
    assert_learns(losses, output)
    features = next(line for line in output.splitlines() if "> MindSpeed backend" in line)
    for flag in extra:
        if flag.startswith("--") and flag[2:] in ("reuse-fp32-param", *(f[2:] for f in MEMORY_SAVERS)):
            assert flag[2:] in features, (flag, features)
    if "--op-cal-tflops" in extra:
        assert_tflops_and_mfu(output, TINY, int(TINY["TRAIN_ITERS"]), "fp32 matmul", abs_tol=1e-6)
    else:                                     # the flag off: no such fields
        assert "TFLOP/s" not in output and "MFU" not in output
    if "--tensorboard-dir" in extra:
        _assert_tensorboard_events(str(tmp_path / "tb"), output)
        _assert_plots(tmp_path, output, losses)


def test_memory_savers_together_at_tp2_pp2_match_the_run_without(tiny_dataset, tmp_path):
    """Issue 12's combination on 4 processes, TP=2 x PP=2: the activation savers and --swap-optimizer
    together give the losses of the run without them bit for bit (recompute and the swaps change
    where tensors live, not what is computed); the feature line names each saver."""
    short = dict(TP="2", PP="2", NPUS_PER_NODE="4", DATA_PATH=tiny_dataset, TRAIN_ITERS="6",
                 EVAL_INTERVAL="6", EVAL_ITERS="1")
    runs = {}
    for name, extra in (("off", []), ("on", MEMORY_SAVERS)):
        loss_file = str(tmp_path / f"{name}.jsonl")
        output = run_example(short, [*extra, "--log-loss-file", loss_file])
        assert "TP 2 x PP 2 x CP 1 x DP 1" in output
        features = next(line for line in output.splitlines() if "> MindSpeed backend" in line)
        for flag in MEMORY_SAVERS:
            assert (flag[2:] in features) == (name == "on"), (flag, features)
        runs[name] = read_losses(loss_file)
    assert sorted(runs["on"]) == list(range(1, 7))
    assert runs["on"] == runs["off"]


def test_two_nodes_train_as_one_node(tiny_dataset, tmp_path, tp2_sp_single_node):
    """NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT: two launches of the script on this machine, one
    process each, acting as two nodes, train the TP=2 + SP run of one 2-process node bit for bit."""
    port, loss_file = _free_port(), str(tmp_path / "losses.jsonl")
    env = dict(os.environ, PYTHON=sys.executable, **TINY, TP="2", PP="1", DATA_PATH=tiny_dataset, NNODES="2",
               NPUS_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    nodes = [subprocess.Popen(["bash", SCRIPT, "--sequence-parallel", "--log-loss-file", loss_file], cwd=ROOT,
                              env=dict(env, NODE_RANK=str(rank)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=LAUNCH_TIMEOUT)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "TP 2 x PP 1 x CP 1 x DP 1" in outputs[0]            # one model over the two nodes
    assert read_losses(loss_file) == tp2_sp_single_node[1]      # ==: bit for bit


# Megatron-Core's names of the launch script's GPT (2 layers, RMSNorm, SwiGLU, no biases, tied output layer)
GPT_WEIGHTS = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
               *(f"decoder.layers.{i}.{name}" for i in (0, 1) for name in (
                   "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                   "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"))}
RNG_STATE = {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states"}


def test_ckpt_format_torch_writes_megatron_lms_legacy_layout(tp2_sp_single_node):
    """iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt per tensor-parallel rank, with Megatron-LM's keys: its
    `args` (the data position in consumed_train_samples), the model's own state dict (each rank its shard),
    the optimizer, the schedule and the RNG state."""
    from mindspeed.checkpoint import legacy
    ckpt = tp2_sp_single_node[2]
    assert sorted(os.listdir(ckpt)) == ["iter_0000006", "iter_0000012", "latest_checkpointed_iteration.txt",
                                        "run_flags.json"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "12"
    for it in ("iter_0000006", "iter_0000012"):
        assert sorted(os.listdir(ckpt / it)) == ["mp_rank_00", "mp_rank_01"]
        assert [os.listdir(ckpt / it / rank) for rank in ("mp_rank_00", "mp_rank_01")] == [["model_optim_rng.pt"]] * 2
    states = [legacy.read_file(str(ckpt / "iter_0000006" / rank / "model_optim_rng.pt"))
              for rank in ("mp_rank_00", "mp_rank_01")]
    for state in states:
        assert set(state) == {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
                              "rng_state"}
        assert (state["iteration"], state["checkpoint_version"]) == (6, 3.0)
        assert (state["args"].consumed_train_samples, state["args"].tensor_model_parallel_size) == (48, 2)
        assert {k for k in state["model"] if not k.endswith("._extra_state")} == GPT_WEIGHTS
        assert state["model"]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (96, 64)   # 3 x 64 / TP
        assert len(state["optimizer"]["state"]) == len(GPT_WEIGHTS)     # Adam's moments of each weight
        assert state["opt_param_scheduler"]["num_steps"] == 48 and set(state["rng_state"][0]) == RNG_STATE
    qkv = [state["model"]["decoder.layers.0.self_attention.linear_qkv.weight"] for state in states]
    assert not torch.equal(*qkv)


def test_ckpt_format_torch_resumes_bit_for_bit_and_a_save_killed_midway_keeps_the_last(
        tp2_sp_single_node, tiny_dataset, tmp_path):
    """--load of the TP=2 legacy checkpoint at iteration 6: iterations 7-12 repeat the uninterrupted run's
    losses bit for bit. Its save of iteration 12 into the same directory, killed (SIGKILL, every process)
    while rank 1 writes its file, leaves the tracked iteration-12 checkpoint byte for byte as it was and
    loadable; the half-written save is in iter_0000012.partial, which no reader takes."""
    from mindspeed.checkpoint import torch_dist
    ckpt, losses = tmp_path / "ckpt", tmp_path / "losses.jsonl"
    shutil.copytree(tp2_sp_single_node[2], ckpt)
    before = snapshot(ckpt / "iter_0000012")
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=_free_port(), DATA_PATH=tiny_dataset, **TINY,
               TP="2", PP="1")
    output = kill_inside_save(["bash", SCRIPT, *LEGACY, "--load", str(ckpt), "--ckpt-step", "6", "--save", str(ckpt),
                               "--log-loss-file", str(losses)], env, "open:iter_0000012.partial/mp_rank_01",
                              tmp_path / "paused", tmp_path / "killed.log", LAUNCH_TIMEOUT,
                              workers=lambda job: _workers(job).values(), cwd=ROOT)
    assert f"loaded checkpoint {ckpt} at iteration 6" in output, output[-3000:]
    resumed = read_losses(losses)
    assert sorted(resumed) == list(range(7, 13))
    assert all(resumed[it] == tp2_sp_single_node[1][it] for it in resumed), (resumed, tp2_sp_single_node[1])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert snapshot(ckpt / "iter_0000012") == before and torch_dist.read_tracker(str(ckpt)) == 12
    assert "mp_rank_01" in os.listdir(ckpt / "iter_0000012.partial")


def _workers(launcher_pid: int) -> dict[int, int]:
    """{RANK: pid} of torchrun's worker processes (its children)."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent == launcher_pid:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
                found[int(env[b"RANK"])] = int(entry)
        except (OSError, KeyError, ValueError):
            continue          # gone meanwhile, or not a worker
    return found


def test_a_killed_worker_restarts_from_the_last_checkpoint(tiny_dataset, tmp_path):
    """MAX_RESTARTS=1: a worker killed (SIGKILL) mid-run; torchrun restarts the job, which resumes from
    the last checkpoint by itself (LOAD_DIR defaults to CKPT_DIR) and finishes. Only the iterations
    since that save are redone, and they repeat the first attempt's losses bit for bit."""
    loss_file, ckpt = tmp_path / "losses.jsonl", tmp_path / "ckpt"
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=_free_port(), DATA_PATH=tiny_dataset,
               **dict(TINY, TRAIN_ITERS="20", EVAL_ITERS="0", EVAL_INTERVAL="1000"),
               CKPT_DIR=str(ckpt), SAVE_INTERVAL="4", MAX_RESTARTS="1")
    # rank 0 is killed (the last stage's rank 1 writes the loss file)
    rc, output, _ = run_interrupted(
        ["bash", SCRIPT, "--npu-deterministic", "--log-loss-file", str(loss_file)], tmp_path / "job.log",
        loss_lines(loss_file, 7), lambda job: os.kill(_workers(job)[0], signal.SIGKILL), LAUNCH_TIMEOUT,
        cwd=ROOT, env=env)
    assert rc == 0, output[-4000:]
    records = [json.loads(line) for line in loss_file.read_text().splitlines()]
    iterations = [r["iteration"] for r in records]
    restart = next(i for i in range(1, len(iterations)) if iterations[i] <= iterations[i - 1])
    first, second = records[:restart], records[restart:]
    killed_after, resumed_from = first[-1]["iteration"], second[0]["iteration"]
    assert killed_after >= 7 and resumed_from > 4 and (resumed_from - 1) % 4 == 0, (killed_after, resumed_from)
    assert resumed_from <= killed_after + 1 and [r["iteration"] for r in second] == list(range(resumed_from, 21))
    before = {r["iteration"]: r["lm_loss"] for r in first}
    redone = [r for r in second if r["iteration"] in before]
    assert all(r["lm_loss"] == before[r["iteration"]] for r in redone), (redone, before)
    assert "no checkpoint yet in this --save directory; starting from iteration 0" in output   # the first start
    assert f"loaded checkpoint {ckpt} at iteration {resumed_from - 1}" in output, output[-3000:]  # the restart


def _assert_plots(tmp_path, output, losses):
    """`python -m mindspeed plot` of this run's log and TensorBoard dir: both runs' series in the figure."""
    from mindspeed.__main__ import main as cli
    from mindspeed.plotting import figure
    from mindspeed.plotting.runs import read_run
    log = tmp_path / "train.log"
    log.write_text(output)
    assert cli(["plot", str(log), str(tmp_path / "tb"), "-o", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    fig = figure.draw([read_run(str(log)), read_run(str(tmp_path / "tb"))])
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].get_lines()}
    assert set(lines) == {"train train", "train validation", "tb train", "tb validation"}
    iterations = sorted(losses)
    for run in ("train", "tb"):
        assert lines[f"{run} train"][0] == iterations          # --log-interval 1: every step
        assert lines[f"{run} train"][1] == pytest.approx([losses[i] for i in iterations], rel=2e-6)
        assert lines[f"{run} validation"][0] == [6, 12]         # at --eval-interval, and the final one
    assert {line.get_label() for line in fig.axes[1].get_lines()} == {"train", "tb"}   # tokens/s


def _assert_tensorboard_events(path, output):
    try:
        import tensorboard  # noqa: F401
    except ImportError:     # the run must say why there are no event files
        assert "needs the 'tensorboard' package" in output
        return
    events = [f for f in os.listdir(path) if f.startswith("events.out.tfevents")]
    assert events, os.listdir(path)
    assert os.stat(os.path.join(path, events[0])).st_mode & 0o007 == 0   # not world-readable


RESUME_ENV = dict(TP="1", PP="1", TRAIN_ITERS="8", EVAL_INTERVAL="100")
RESUME_FLAGS = ["--use-distributed-optimizer", "--deterministic-mode"]


@pytest.fixture(scope="module")
def saved_run(tiny_dataset, tmp_path_factory):
    """8 steps saving at 4 and 8: (checkpoint root, losses by iteration)."""
    tmp = tmp_path_factory.mktemp("saved")
    ckpt, full = str(tmp / "ckpt"), str(tmp / "full.jsonl")
    run_example(dict(RESUME_ENV, DATA_PATH=tiny_dataset),
                [*RESUME_FLAGS, "--save", ckpt, "--save-interval", "4", "--log-loss-file", full])
    return ckpt, read_losses(full)


def test_sigterm_to_the_whole_job_saves_the_iteration_and_the_resumed_run_repeats_the_losses(
        saved_run, tiny_dataset, tmp_path):
    """--exit-signal-handler: SIGTERM to the launcher and every worker, as a cluster scheduler sends it.
    Each worker finishes its step, the job saves that iteration and every process exits without a
    traceback; resuming from it gives the uninterrupted run's losses (saved_run) bit for bit."""
    ckpt, losses = tmp_path / "ckpt", tmp_path / "losses.jsonl"
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=_free_port(), DATA_PATH=tiny_dataset,
               **dict(TINY, **RESUME_ENV), CKPT_DIR=str(ckpt), SHUTDOWN_TIMEOUT=str(LAUNCH_TIMEOUT))
    # torchrun forwards the signal to its workers too
    rc, output, _ = run_interrupted(
        ["bash", SCRIPT, *RESUME_FLAGS, "--exit-signal-handler", "--log-loss-file", str(losses)], tmp_path / "job.log",
        loss_lines(losses, 2), lambda job: sigterm_everyone(job, _workers(job).values()), LAUNCH_TIMEOUT,
        cwd=ROOT, env=env)
    stopped = re.search(r"> exiting at iteration (\d+): received SIGTERM", output)
    assert stopped and rc == 128 + signal.SIGTERM, output[-3000:]
    assert "Traceback" not in output and "forcefully exiting" not in output, output[-3000:]
    assert "torchrun: stopped by SIGTERM: forwarded to the workers, which have exited" in output
    at = int(stopped[1])
    assert 2 <= at < 8 and (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(at)
    assert "final validation loss at" not in output          # as Megatron: saved, then out

    resumed = tmp_path / "resumed.jsonl"
    run_example(dict(RESUME_ENV, DATA_PATH=tiny_dataset),
                [*RESUME_FLAGS, "--load", str(ckpt), "--log-loss-file", str(resumed)])
    before, after = read_losses(losses), read_losses(resumed)
    assert sorted(after) == list(range(at + 1, 9))
    assert all(before[it] == saved_run[1][it] for it in before)
    assert all(after[it] == saved_run[1][it] for it in after), (after, saved_run[1])


def test_kill_9_during_a_save_resumes_from_the_last_complete_checkpoint(tiny_dataset, tmp_path):
    """SIGKILL to every process of the job while it writes the iteration-8 checkpoint's shards (paused
    there, inside Megatron's real writer: killed_save): the tracker still names iteration 4 and the
    half-written save is in iter_0000008.partial, which no reader takes. The same command again
    resumes from 4, redoes 5-8 with the killed run's losses bit for bit and completes iteration 8.
    Then a save of the tracked iteration 8 again (--ckpt-step 4), killed the same way, leaves
    iter_0000008 byte for byte as it was."""
    ckpt, losses = tmp_path / "ckpt", tmp_path / "losses.jsonl"
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=_free_port(), DATA_PATH=tiny_dataset,
               **dict(TINY, **RESUME_ENV), CKPT_DIR=str(ckpt), LOAD_DIR=str(ckpt), SAVE_INTERVAL="4")
    command = ["bash", SCRIPT, *RESUME_FLAGS, "--log-loss-file", str(losses)]
    kill_inside_save(command, env, "open:iter_0000008", tmp_path / "paused", tmp_path / "killed.log",
                     LAUNCH_TIMEOUT, workers=lambda job: _workers(job).values(), cwd=ROOT)
    killed = assert_killed_in_the_save_of_8(ckpt, losses, "common.pt")

    output = run_example(dict(env, MASTER_PORT=_free_port()), [*RESUME_FLAGS, "--log-loss-file", str(losses)])  # same command
    assert "Traceback" not in output, output[-3000:]
    assert f"loaded checkpoint {ckpt} at iteration 4" in output and "training from iteration 4 to 8" in output
    assert_redid_5_to_8(ckpt, losses, killed)

    before = snapshot(ckpt / "iter_0000008")
    kill_inside_save([*command, "--ckpt-step", "4"], dict(env, MASTER_PORT=_free_port()), "open:iter_0000008",
                     tmp_path / "paused_again", tmp_path / "killed_again.log", LAUNCH_TIMEOUT,
                     workers=lambda job: _workers(job).values(), cwd=ROOT)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert snapshot(ckpt / "iter_0000008") == before


def test_a_rank_that_hangs_in_a_collective_stops_the_job_within_the_timeout(tiny_dataset, tmp_path):
    """TP=2 with --distributed-timeout-minutes 0.1 (6 s): rank 1 stopped with SIGSTOP once iteration
    2 is logged (alive, it never joins another collective). Rank 0 exits within the timeout (plus
    the load's slack) with one line naming the collective, its ranks and rank 1, no traceback. The
    stopped rank is then killed as a scheduler would (torchrun itself would wait 30 s before its
    SIGKILL), and the launcher ends in one line."""
    losses = tmp_path / "losses.jsonl"
    env = dict(os.environ, PYTHON=sys.executable, MASTER_PORT=_free_port(), DATA_PATH=tiny_dataset,
               **dict(TINY, TP="2", PP="1", TRAIN_ITERS="200", EVAL_INTERVAL="1000"))

    def stop_rank_1(job):
        workers = _workers(job)
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        while _running(workers[0]) and time.monotonic() < stopped + 120:
            time.sleep(0.1)
        took = time.monotonic() - stopped
        os.kill(workers[1], signal.SIGKILL)
        return took

    rc, output, took = run_interrupted(["bash", SCRIPT, "--distributed-timeout-minutes", "0.1", "--log-loss-file",
                                        str(losses)], tmp_path / "job.log", loss_lines(losses, 2), stop_rank_1,
                                       LAUNCH_TIMEOUT, cwd=ROOT, env=env)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert rc == 1 and len(errors) == 1 and "Traceback" not in output, output[-3000:]
    # where rank 1 stopped decides where rank 0 waits: in a torch.distributed call, or on an
    # asynchronous collective (Megatron's TP all-reduce in the backward), named by who waited for it
    assert re.fullmatch(r"error: rank 0: (torch\.distributed\.\w+|a collective waited for in \w+) over ranks \[0, 1\] "
                        r"timed out after 6 s "
                        r"\(--distributed-timeout-minutes 0\.1\): rank 1 never joined it .*", errors[0]), errors
    assert "torchrun: worker rank 0 exited with code 1" in output, output[-2000:]
    assert took < 6 + 20, f"rank 0 ran {took:.0f} s after rank 1 stopped"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _launch_ranks(args, world=2, timeout=120):
    """pretrain_gpt.py on `world` ranks started directly (the environment torchrun would give them,
    without torchrun's own report on top): [(exit code, stderr)] by rank. A rank that hangs fails."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MASTER_ADDR="localhost",
               MASTER_PORT=_free_port(), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    procs = [subprocess.Popen([sys.executable, PRETRAIN, *args], cwd=ROOT, text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]
    results = []
    try:
        for proc in procs:
            _out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


def test_checkpoint_files_are_private(saved_run):
    ckpt, _ = saved_run
    for dirpath, _dirs, files in os.walk(ckpt):
        assert oct(os.stat(dirpath).st_mode & 0o777) == oct(0o750), dirpath
        for name in files:
            assert oct(os.stat(os.path.join(dirpath, name)).st_mode & 0o777) == oct(0o640), name


def test_truncated_checkpoint_stops_every_rank_then_the_named_one_resumes(saved_run, tiny_dataset, tmp_path):
    """The step-8 shard cut to 100 bytes: resuming stops both ranks with the same single line (exit
    code 2) naming the file and iteration 4 with its flag, and changes nothing; loading what that
    line names reproduces the uninterrupted run's steps 5..8."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved_run[0], ckpt)
    shard = os.path.join(ckpt, "iter_0000008", "__0_0.distcp")
    os.truncate(shard, 100)
    before = snapshot(ckpt)
    results = _launch_ranks(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                             "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
                             "--train-iters", "8", "--data-path", tiny_dataset, *RESUME_FLAGS, "--load", ckpt])
    lines = []
    for rc, err in results:
        assert "Traceback" not in err, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(errors) == 1, (rc, err[-3000:])
        lines.append(errors[0])
    assert lines[0] == lines[1], lines
    assert shard in lines[0] and "truncated (100 bytes" in lines[0], lines[0]
    assert snapshot(ckpt) == before                       # tracker and checkpoints untouched
    named = re.search(r"the last readable checkpoint is iteration 4: load it with --load (\S+) --ckpt-step (\d+)",
                      lines[0])
    assert named, lines[0]

    resumed = str(tmp_path / "resumed.jsonl")
    output = run_example(dict(RESUME_ENV, DATA_PATH=tiny_dataset),
                         [*RESUME_FLAGS, "--load", named[1], "--ckpt-step", named[2], "--log-loss-file", resumed])
    assert "loaded checkpoint" in output and "at iteration 4" in output
    a, b = saved_run[1], read_losses(resumed)
    assert sorted(b) == [5, 6, 7, 8]
    for it in (5, 6, 7, 8):
        assert abs(a[it] - b[it]) <= 1e-6, (it, a[it], b[it])
    assert snapshot(ckpt) == before


def _pretrain_single(args, env=None, timeout=180):
    result = subprocess.run([sys.executable, PRETRAIN, "--num-layers", "2", "--hidden-size", "64",
                             "--num-attention-heads", "4", "--seq-length", "32", "--train-iters", "2", *args],
                            cwd=ROOT, env=dict(os.environ, **(env or {})), capture_output=True, text=True,
                            timeout=timeout)
    return result.returncode, result.stdout + result.stderr


def test_bad_inputs_fail_before_training(tiny_dataset, tmp_path):
    # a dataset prefix that does not exist
    rc, out = _pretrain_single(["--data-path", str(tmp_path / "missing")])
    assert rc == 2 and "is missing" in out and "training from iteration" not in out
    # a truncated .bin
    broken = str(tmp_path / "broken")
    for suffix in (".idx", ".tokenizer.json"):
        with open(tiny_dataset + suffix, "rb") as src, open(broken + suffix, "wb") as dst:
            dst.write(src.read())
    with open(tiny_dataset + ".bin", "rb") as src, open(broken + ".bin", "wb") as dst:
        dst.write(src.read()[:-100])
    rc, out = _pretrain_single(["--data-path", broken])
    assert rc == 2 and "truncated" in out and "training from iteration" not in out
    # a --load directory that holds no checkpoint
    empty = tmp_path / "not_a_checkpoint"
    empty.mkdir()
    rc, out = _pretrain_single(["--data-path", tiny_dataset, "--load", str(empty)])
    assert rc == 2 and "latest_checkpointed_iteration.txt" in out and "training from iteration" not in out


def test_a_full_disk_during_a_save_stops_the_run_in_one_line_and_keeps_the_last_checkpoint(tiny_dataset, tmp_path):
    """A 16 MB tmpfs as --save: once the iteration-10 checkpoint is written the disk is filled, so the
    final save (iteration 20) fails. The run stops with one line naming the cause, the tracker still
    names iteration 10, and that checkpoint loads."""
    args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--data-path", tiny_dataset, "--eval-iters", "0",
            "--split", "90,10,0"]
    with small_tmpfs(tmp_path / "disk", 16) as disk:
        ckpt = disk / "ckpt"
        rc, _output, error = run_filling_after_first_save(
            [sys.executable, PRETRAIN, *args, "--train-iters", "20", "--save", str(ckpt), "--save-interval", "10"],
            disk, ckpt, tmp_path / "run.log", LAUNCH_TIMEOUT, cwd=ROOT)
        assert rc == 2 and str(ckpt) in error and "No space left on device" in error, error   # iteration 20
        rc, out = _pretrain_single([*args, "--load", str(ckpt), "--train-iters", "11"])
        assert rc == 0 and f"loaded checkpoint {ckpt} at iteration 10" in out, out[-3000:]


def test_bad_parallel_sizes_and_load_path_are_refused(tiny_dataset, capsys, monkeypatch):
    """Argument errors are reported by pretrain_gpt.main before torch or Megatron do any work."""
    monkeypatch.syspath_prepend(os.path.dirname(PRETRAIN))
    import pretrain_gpt
    cases = [(["--tensor-model-parallel-size", "3"], "2", "world size 2 is not divisible"),
             (["--pipeline-model-parallel-size", "2", "--num-layers", "3"], "2", "--num-layers 3 is not divisible"),
             (["--load", "/nonexistent/ckpt"], "1", "--load path")]
    for argv, world, message in cases:
        monkeypatch.setenv("WORLD_SIZE", world)
        rc = pretrain_gpt.main(["--data-path", tiny_dataset, *argv])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, (argv, err)


def test_each_kind_of_damage_is_named_in_one_line(saved_run, tmp_path):
    """In-process, on copies of the saved checkpoint: what check_iteration finds before a load, what
    a failed load reports (the loader raises the same CheckpointException on every rank), and that
    the index is read without running code."""
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException

    from mindspeed.checkpoint import torch_dist as ck
    from mindspeed.errors import CheckpointError

    def copy(name):
        root = str(tmp_path / name)
        shutil.copytree(saved_run[0], root)
        return root, os.path.join(root, "iter_0000008")

    def refused(root, step=None):
        with pytest.raises(CheckpointError) as info:
            ck.read_tracker(root, step)
        message = str(info.value)
        assert "\n" not in message
        return message

    root, it8 = copy("index_truncated")
    with open(os.path.join(it8, ".metadata"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    message = refused(root)
    assert f"{it8}/.metadata is unreadable" in message and "--load " + root + " --ckpt-step 4" in message

    root, it8 = copy("index_runs_code")
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)
    with open(os.path.join(it8, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    message = refused(root)
    assert "could run code" in message and not marker.exists(), message

    root, it8 = copy("common_truncated")
    os.truncate(os.path.join(it8, "common.pt"), 10)
    assert f"{it8}/common.pt is unreadable" in refused(root)

    root, it8 = copy("shard_missing")
    os.remove(os.path.join(it8, "__1_1.distcp"))
    assert f"{it8}/__1_1.distcp is missing" in refused(root)
    with open(os.path.join(root, ck.TRACKER), "w") as f:
        f.write("garbage")
    message = refused(root)
    assert "should hold an iteration number" in message and "--ckpt-step 4" in message
    message = refused(root, step=5)
    assert "iter_0000005 does not exist" in message and "--ckpt-step 4" in message
    assert ck.read_tracker(root, step=4) == 4

    # damage inside a shard that keeps its length: only the load finds it; the report names the file
    root, it8 = copy("shard_zeroed")
    shard = os.path.join(it8, "__0_0.distcp")
    # the header of the shard's largest tensor record (zeroing raw tensor bytes alone still decodes)
    records = [(info.length, info.offset) for info in ck.read_index(it8).storage_data.values()
               if info.relative_path == "__0_0.distcp"]
    with open(shard, "r+b") as f:
        f.seek(max(records)[1])
        f.write(bytes(64))
    assert ck.check_iteration(it8) is None
    failure = CheckpointException("read", {0: (EOFError(), None), 1: (EOFError(), None)})
    message = str(ck._load_failure(root, 8, failure))
    assert f"{shard} is corrupt: tensor" in message and "--ckpt-step 4" in message and "\n" not in message

    # a MindSpore (neutral safetensors) checkpoint given to the torch trainer is checked as one
    neutral = tmp_path / "neutral"
    (neutral / "iter_0000002").mkdir(parents=True)
    (neutral / "iter_0000002" / "model.safetensors").write_bytes(b"")
    (neutral / ck.TRACKER).write_text("2")
    assert f"{neutral}/iter_0000002/model.safetensors is truncated (0 bytes" in refused(str(neutral))

    # an intact checkpoint that does not fit the model: the first rank's reason, one line
    failure = CheckpointException("read", {1: (ValueError("shape\nmismatch"), None), 0: (KeyError("w"), None)})
    message = str(ck._load_failure(saved_run[0], 8, failure))
    assert message == f"cannot load checkpoint {saved_run[0]}/iter_0000008: KeyError: 'w' (rank 0)", message
