"""`--context-parallel-size 2` trains the tiny GPT of the main training job on 2 processes, and
every algorithm's losses over 10 steps match the CP=1 run on the same 2 processes (data parallel:
the same global batch of the same samples, the same initialisation). One spawn runs all five
trainings in turn (each with its own rendezvous port) to keep CI time down."""
import json
import os

import pytest

from tests_extend.distributed.harness import free_port, run_distributed

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--global-batch-size", "2", "--train-iters", "10",
        "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "10", "--lr", "3e-3",
        "--mock-data", "--seed", "7", "--deterministic-mode"]
RUNS = {
    "cp1": ["--micro-batch-size", "1"],
    "ulysses": ["--micro-batch-size", "2", "--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo"],
    "ring": ["--micro-batch-size", "2", "--context-parallel-size", "2", "--context-parallel-algo", "megatron_cp_algo",
             "--use-cp-send-recv-overlap"],
    "ring-general-mask": ["--micro-batch-size", "2", "--context-parallel-size", "2", "--context-parallel-algo",
                          "megatron_cp_algo", "--attention-mask-type", "general"],
    "hybrid": ["--micro-batch-size", "2", "--context-parallel-size", "2", "--context-parallel-algo", "hybrid_cp_algo",
               "--ulysses-degree-in-cp", "1"],
}


def _train_all(rank, world_size, ports, tmp):
    import torch.distributed as dist

    import mindspeed
    from mindspeed.training.arguments import parse_args
    from mindspeed.training.pretrain import run
    losses = {}
    for (name, extra), port in zip(RUNS.items(), ports):
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(port)
        loss_file = os.path.join(tmp, f"{name}.jsonl")
        args = parse_args(TINY + ["--log-loss-file", loss_file] + extra)
        mindspeed.adapt(args)
        try:
            run(args)
        finally:
            mindspeed.unadapt()
        if rank == 0:
            with open(loss_file) as f:
                losses[name] = [json.loads(line)["lm_loss"] for line in f]
    return losses


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("cp_training"))
    ports = [free_port() for _ in RUNS]
    return run_distributed(_train_all, world_size=2, args=(ports, tmp), timeout=420)[0]


def test_cp1_trains(losses):
    assert len(losses["cp1"]) == 10 and losses["cp1"][-1] < losses["cp1"][0] - 0.1


@pytest.mark.parametrize("algo", ["ulysses", "ring", "ring-general-mask", "hybrid"])
def test_cp2_matches_cp1_losses(losses, algo):
    assert losses[algo] == pytest.approx(losses["cp1"], rel=5e-5, abs=5e-5)
