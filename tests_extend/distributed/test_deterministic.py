"""--npu-deterministic on the torch trainer: two runs with the same seed give bitwise-identical
losses at TP=2 and at DP=2 (2 processes, 2 steps each), with the deterministic switches on during
the runs and off again after unadapt(). One spawn runs the four trainings in turn (CI time). The
MindSpore trainer's runs with the flag: tests_extend/system/test_mindspore_train_script.py."""
import json
import os

import pytest

from tests_extend.distributed.harness import next_rendezvous, run_distributed

TINY = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "2",
        "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "2", "--lr", "3e-3",
        "--mock-data", "--seed", "11", "--npu-deterministic"]
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2", "--global-batch-size", "2"],
           "dp2": ["--global-batch-size", "4"]}


def _train_twice(rank, world_size, tmp):
    import torch

    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.pretrain import run
    out = {}
    for name, layout in LAYOUTS.items():
        for attempt in ("a", "b"):
            loss_file = os.path.join(tmp, f"{name}-{attempt}.jsonl")
            next_rendezvous(rank, loss_file + ".port")
            args = parse_args(TINY + layout + ["--log-loss-file", loss_file])
            session = mindspeed.adapt(args)
            try:
                run(args, session)
                # what the flag switched on, seen from inside the run
                out[f"{name}-{attempt}/switches"] = (torch.are_deterministic_algorithms_enabled(),
                                                     torch.backends.cudnn.deterministic, args.deterministic_mode)
            finally:
                mindspeed.unadapt()
            out[f"{name}-{attempt}/after"] = torch.are_deterministic_algorithms_enabled()
            if rank == 0:
                with open(loss_file) as f:
                    out[f"{name}-{attempt}"] = [json.loads(line)["lm_loss"] for line in f]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_train_twice, world_size=2, args=(str(tmp_path_factory.mktemp("det")),),
                           timeout=300)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_same_seed_gives_bitwise_identical_losses(runs, layout):
    first, second = runs[0][f"{layout}-a"], runs[0][f"{layout}-b"]
    assert len(first) == 2 and first == second          # ==: bit for bit, no tolerance


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_deterministic_switches_are_on_during_the_run_and_undone_after(runs, layout):
    for rank in (0, 1):
        for attempt in ("a", "b"):
            assert runs[rank][f"{layout}-{attempt}/switches"] == (True, True, True)
            assert runs[rank][f"{layout}-{attempt}/after"] is False

