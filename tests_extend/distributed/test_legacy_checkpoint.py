"""--ckpt-format torch (Megatron-LM's legacy per-rank checkpoint, mindspeed/checkpoint/legacy.py) on the
torch trainer's own save and resume (pretrain.loop_parts' save, pretrain.resume), 2 real processes, real
Megatron-Core model and optimizers; one spawn for every case (CI time):

* DP=2 with the distributed optimizer (bf16: fp32 masters): one mp_rank_00 directory, its
  model_optim_rng.pt and distrib_optim.pt (the masters and Adam's moments gathered from both
  data-parallel ranks). A fresh trainer of another initialisation, run without --ckpt-format torch,
  loads it: weights, masters, moments, step, schedule, data position and RNG state as saved, and the
  next update equal bit for bit to the uninterrupted trainer's; with --no-load-rng the RNG stays as it was.
* refused in one line on every rank: the checkpoint without the distributed optimizer, a --no-save-optim
  one without --no-load-optim (which then loads it), a truncated file (named, with the last readable
  iteration), and the checkpoint at TP=2 (it was saved at TP=1: legacy files are per rank).
* the other way round: a torch_dist checkpoint resumes a --ckpt-format torch run (the format is the
  directory's).
* a save whose publish fails on rank 0 (either format) stops both ranks with the same one-line error; the
  previous checkpoint stays tracked and resumes.
The TP=2 save, its layout and a bit-for-bit resume through the launch script are in
tests_extend/system/test_pretrain_gpt.py.
"""
import hashlib
import os

import pytest

from tests_extend.distributed.harness import run_distributed

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "8", "--lr", "1e-2",
        "--mock-data", "--bf16"]
DIST = ["--use-distributed-optimizer"]


class _Log:
    def print(self, *_):
        pass


def _trainer(flags, seed: int):
    import torch
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training import pretrain
    args = parse_args(TINY + flags, world_size=2)
    args.device_name = "cpu"
    args.vocab_size, args.padded_vocab_size = 60, 128
    torch.manual_seed(seed)
    return args, pretrain.Trainer(args, _Log())


def _step(trainer, k: int) -> None:
    """One update from fixed gradients (different per rank, element and step)."""
    import torch
    rank = torch.distributed.get_rank()
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
        for p in chunk.parameters():
            p.main_grad.copy_(torch.linspace(-1, 1, p.numel()).view_as(p) * 0.01 * k * (rank + 1))
    trainer.optimizer.step()
    trainer.scheduler.step(increment=trainer.args.global_batch_size)


def _digest(trainer) -> str:
    """The model's weights and this rank's fp32 masters, bit for bit."""
    h = hashlib.sha256()
    for p in trainer.model[0].parameters():
        h.update(p.detach().float().numpy().tobytes())
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


def _save(args, trainer, iteration: int, consumed: int) -> None:
    """The trainer's own save (what its loop calls at --save-interval)."""
    from mindspeed.backends import get_backend
    from mindspeed.training import pretrain
    pretrain.loop_parts(args, trainer, None, None, get_backend()).save(iteration, consumed)


def _refusal(args, trainer) -> str | None:
    from mindspeed.errors import CheckpointError
    from mindspeed.training import pretrain
    try:
        pretrain.resume(args, trainer, _Log())
    except CheckpointError as err:
        return str(err)
    return None


def _dp2_cases(rank, root) -> dict:
    import torch
    from mindspeed.training import pretrain
    ckpt = os.path.join(root, "ckpt")
    args, trainer = _trainer(DIST + ["--ckpt-format", "torch", "--save", ckpt], seed=1)
    for k in (1, 2):
        _step(trainer, k)
    saved_rng, saved_lr = torch.get_rng_state().clone(), trainer.optimizer.param_groups[0]["lr"]
    _save(args, trainer, 2, 4)
    out = {"files": sorted(os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt) for f in fs)}
    saved = _digest(trainer)
    _step(trainer, 3)
    out["uninterrupted"] = _digest(trainer)

    args, fresh = _trainer(DIST + ["--load", ckpt], seed=2)          # --ckpt-format torch_dist (the default)
    torch.manual_seed(99)
    out["resumed_at"] = list(pretrain.resume(args, fresh, _Log()))
    out["rng_restored"] = torch.equal(torch.get_rng_state(), saved_rng)
    out["loaded"] = _digest(fresh) == saved
    out["lr"] = (fresh.optimizer.param_groups[0]["lr"], saved_lr)
    _step(fresh, 3)
    out["resumed"] = _digest(fresh)

    args, kept = _trainer(DIST + ["--load", ckpt, "--no-load-rng"], seed=2)
    before = torch.get_rng_state().clone()
    pretrain.resume(args, kept, _Log())
    out["no_load_rng_untouched"] = torch.equal(torch.get_rng_state(), before)
    out["without_distributed_optimizer"] = _refusal(*_trainer(["--load", ckpt], seed=2))
    out.update(_no_save_optim_cases(root, trainer))
    return out


def _no_save_optim_cases(root, trainer) -> dict:
    from mindspeed.training import pretrain
    weights = os.path.join(root, "weights")
    args, _ = _trainer(DIST + ["--ckpt-format", "torch", "--save", weights, "--no-save-optim"], seed=1)
    _save(args, trainer, 3, 6)
    out = {"no_save_optim": _refusal(*_trainer(DIST + ["--load", weights], seed=2))}
    args, fresh = _trainer(DIST + ["--load", weights, "--no-load-optim"], seed=2)
    out["no_load_optim"] = list(pretrain.resume(args, fresh, _Log()))
    return out


def _truncated(rank, root) -> str | None:
    """A copy of the checkpoint with its newest model file cut short: refused before any collective."""
    import shutil

    from mindspeed.checkpoint import torch_dist
    from mindspeed.errors import CheckpointError
    copy = os.path.join(root, f"truncated{rank}")
    shutil.copytree(os.path.join(root, "ckpt"), copy)
    shutil.copytree(os.path.join(copy, "iter_0000002"), os.path.join(copy, "iter_0000001"))
    path = os.path.join(copy, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    os.truncate(path, os.path.getsize(path) // 2)
    try:
        torch_dist.read_tracker(copy)
    except CheckpointError as err:
        return str(err)
    return None


def _tp2_cases(rank, root) -> dict:
    """At TP=2: the TP=1 legacy checkpoint refused; a torch_dist checkpoint resumes a --ckpt-format torch run."""
    from megatron.core import parallel_state

    from mindspeed.checkpoint import torch_dist
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training import pretrain
    parallel_state.destroy_model_parallel()
    pretrain._init_distributed(parse_args(TINY + ["--tensor-model-parallel-size", "2"], world_size=2), "cpu")
    args, trainer = _trainer(["--tensor-model-parallel-size", "2", "--load", os.path.join(root, "ckpt")], seed=1)
    out = {"other_layout": _refusal(args, trainer)}
    _step(trainer, 1)
    torch_dist.save_checkpoint(os.path.join(root, "td"), 1, trainer.model, trainer.optimizer, trainer.scheduler, 2)
    out["publish_failed"] = _publish_failures(rank, os.path.join(root, "td"), args, trainer)
    args, fresh = _trainer(["--tensor-model-parallel-size", "2", "--ckpt-format", "torch", "--load",
                            os.path.join(root, "td")], seed=2)
    out["torch_dist_into_torch"] = [*pretrain.resume(args, fresh, _Log()), _digest(fresh) == _digest(trainer)]
    return out


def _publish_failures(rank, ckpt, args, trainer) -> dict:
    """Rank 0's publish of iteration 2 fails (a file lies where iter_0000002 goes: the rename raises
    NotADirectoryError) in either format: every rank's CheckpointError (None if it returned), and the
    tracker after each. It hung before: the other rank waited at a barrier for rank 0, which had raised."""
    from mindspeed.checkpoint import legacy, torch_dist
    from mindspeed.errors import CheckpointError
    in_the_way = os.path.join(ckpt, "iter_0000002")
    if rank == 0:
        with open(in_the_way, "w") as f:
            f.write("not a checkpoint")
    saves = {"torch_dist": lambda: torch_dist.save_checkpoint(ckpt, 2, trainer.model, trainer.optimizer,
                                                              trainer.scheduler, 4),
             "legacy": lambda: legacy.save_checkpoint(ckpt, 2, trainer.model, trainer.optimizer, trainer.scheduler,
                                                      4, args=args)}
    out = {}
    for name, save in saves.items():
        try:
            save()
            out[name] = None
        except CheckpointError as err:
            out[name] = str(err)
        with open(os.path.join(ckpt, torch_dist.TRACKER)) as f:
            out[f"{name}_tracker"] = f.read()
    legacy.agreed(None)                   # both ranks done before the file goes
    if rank == 0:
        os.remove(in_the_way)
    return out


def _body(rank, world_size, root):
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training import pretrain
    args = parse_args(TINY, world_size=2)
    mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain._set_seeds(args)
    out = _dp2_cases(rank, root)
    out["truncated"] = _truncated(rank, root)
    out.update(_tp2_cases(rank, root))
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("legacy"))
    return run_distributed(_body, world_size=2, args=(root,), timeout=300, daemon=False)


def test_dp2_distributed_optimizer_writes_megatron_lms_files(report):
    assert report[0]["files"] == ["iter_0000002/mp_rank_00/distrib_optim.pt",
                                  "iter_0000002/mp_rank_00/model_optim_rng.pt", "latest_checkpointed_iteration.txt"]


def test_a_fresh_trainer_resumes_bit_for_bit(report):
    for rank in (0, 1):
        r = report[rank]
        assert r["resumed_at"] == [2, 4] and r["loaded"] and r["rng_restored"], r
        assert r["lr"][0] == r["lr"][1]
        assert r["resumed"] == r["uninterrupted"]           # the masters, moments and step came back
        assert r["no_load_rng_untouched"]


def test_what_does_not_fit_is_refused_in_one_line_on_every_rank(report):
    for rank in (0, 1):
        r = report[rank]
        for key, text in (("without_distributed_optimizer", "was saved with --use-distributed-optimizer "
                                                             "(distrib_optim.pt): add that flag, or resume it with "
                                                             "--no-load-optim"),
                          ("no_save_optim", "holds no optimizer state (saved with --no-save-optim): resume it with "
                                            "--no-load-optim"),
                          ("other_layout", "is Megatron-LM's legacy per-rank format (--ckpt-format torch), saved at "
                                           "TP 1 x PP 1 x EP 1: it loads only at those sizes (this run: TP 2 x PP 1 "
                                           "x EP 1)"),
                          ("truncated", "iter_0000002/mp_rank_00/model_optim_rng.pt is ")):
            assert r[key] and text in r[key] and "\n" not in r[key], (key, r[key])
        assert "the last readable checkpoint is iteration 1" in r["truncated"]
        assert r["no_load_optim"] == [3, 6]


def test_a_failed_publish_stops_every_rank_in_one_line(report):
    """Rank 0 cannot publish: both ranks raise the same line (rank 0's cause), the tracker still names
    iteration 1, and that checkpoint then resumes (the next test)."""
    for name in ("torch_dist", "legacy"):
        lines = {report[rank]["publish_failed"][name] for rank in (0, 1)}
        assert len(lines) == 1, lines
        line = lines.pop()
        assert line and "\n" not in line and "iter_0000002" in line and "Not a directory (rank 0)" in line, line
        assert line.endswith("the tracker still names the last complete checkpoint"), line
        assert all(report[rank]["publish_failed"][f"{name}_tracker"] == "1" for rank in (0, 1))


def test_a_torch_dist_checkpoint_resumes_a_legacy_format_run(report):
    assert report[0]["torch_dist_into_torch"] == [1, 2, True]
