"""`--context-parallel-size 2` trains the tiny GPT of the main training job on 2 processes, and
every algorithm's losses over 10 steps match the CP=1 run on the same 2 processes (data parallel:
the same global batch of the same samples, the same initialisation). On 4 processes, CP=4 hybrid
(Ulysses 2 x ring 2) and the double ring (inner rings of 2) match the same CP=1 losses (first 4 steps). On
packed short documents (--reset-attention-mask, varlen attention), CP 2 ring, Ulysses and the KV
all-gather match CP 1. One spawn per world size runs its trainings in turn (each with its own
rendezvous port) to keep CI time down."""
import json
import os

import pytest

from tests_extend.distributed.harness import next_rendezvous, run_distributed

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--global-batch-size", "2", "--train-iters", "10",
        "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "10", "--lr", "3e-3",
        "--mock-data", "--seed", "7", "--deterministic-mode"]
RUNS = {
    "cp1": ["--micro-batch-size", "1"],
    "ulysses": ["--micro-batch-size", "2", "--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo"],
    "ring": ["--micro-batch-size", "2", "--context-parallel-size", "2", "--context-parallel-algo", "megatron_cp_algo",
             "--use-cp-send-recv-overlap"],
    "kvallgather": ["--micro-batch-size", "2", "--context-parallel-size", "2", "--context-parallel-algo",
                    "kvallgather_cp_algo"],
    "ring-general-mask": ["--micro-batch-size", "2", "--context-parallel-size", "2", "--context-parallel-algo",
                          "megatron_cp_algo", "--attention-mask-type", "general"],
}
CP4_STEPS = 4   # 4 processes share 2 cores: the first 4 of the 10 steps (same schedule, --exit-interval)
RUNS_CP4 = {   # 4 processes: CP 4 x DP 1, the same global batch of 2
    "hybrid-u2xring2": ["--micro-batch-size", "2", "--context-parallel-size", "4", "--context-parallel-algo",
                        "hybrid_cp_algo", "--ulysses-degree-in-cp", "2", "--exit-interval", str(CP4_STEPS)],
    "double-ring": ["--micro-batch-size", "2", "--context-parallel-size", "4", "--context-parallel-algo",
                    "megatron_cp_algo", "--cp-window-size", "2", "--use-cp-send-recv-overlap",
                    "--exit-interval", str(CP4_STEPS)],
}
# packed short documents (EOD reset, varlen attention): CP 2 ring, Ulysses, KV all-gather against CP 1, 4 steps
EOD_STEPS = 4
DATA = "DATA"    # replaced by the dataset of short documents the fixture writes
EOD = ["--data-path", DATA, "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--split", "100,0,0",
       "--reset-attention-mask", "--reset-position-ids", "--use-flash-attn", "--exit-interval", str(EOD_STEPS)]
RUNS.update({
    "eod-cp1": EOD + ["--micro-batch-size", "1"],
    "eod-ring": EOD + ["--micro-batch-size", "2", "--context-parallel-size", "2",
                       "--context-parallel-algo", "megatron_cp_algo"],
    "eod-ulysses": EOD + ["--micro-batch-size", "2", "--context-parallel-size", "2",
                          "--context-parallel-algo", "ulysses_cp_algo"],
    "eod-kvallgather": EOD + ["--micro-batch-size", "2", "--context-parallel-size", "2",
                              "--context-parallel-algo", "kvallgather_cp_algo"],
})
# what the CP feature must have built for each run: (algo, Ulysses degree, ring size, window)
BUILT = {"ulysses": ("ulysses_cp_algo", 2, 1, 1), "ring": ("megatron_cp_algo", 1, 2, 1),
         "ring-general-mask": ("megatron_cp_algo", 1, 2, 1), "hybrid-u2xring2": ("hybrid_cp_algo", 2, 2, 1),
         "double-ring": ("megatron_cp_algo", 1, 4, 2), "eod-ring": ("megatron_cp_algo", 1, 2, 1),
         "eod-ulysses": ("ulysses_cp_algo", 2, 1, 1), "kvallgather": ("kvallgather_cp_algo", 1, 1, 1),
         "eod-kvallgather": ("kvallgather_cp_algo", 1, 1, 1)}


def _documents(tmp) -> str:
    """An indexed dataset of 300 short documents (2-12 tokens + EOD 64): every 32-token sample packs
    several, with boundaries anywhere in the CP chunks. Written by rank 0 before the first run."""
    import numpy as np
    from mindspeed.data.indexed import write_dataset
    prefix = os.path.join(tmp, "documents")
    if not os.path.exists(prefix + ".idx"):
        rng = np.random.default_rng(3)
        write_dataset(prefix, (np.append(rng.integers(0, 64, rng.integers(2, 13)), 64) for _ in range(300)), 65)
    return prefix


def _train_all(rank, world_size, runs, tmp):
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.pretrain import run
    losses = {}
    for name, extra in runs.items():
        loss_file = os.path.join(tmp, f"{name}.jsonl")
        next_rendezvous(rank, loss_file + ".port")
        if DATA in extra:      # a real dataset instead of the mock one
            base = [a for a in TINY if a != "--mock-data"]
            extra = [_documents(tmp) if a == DATA else a for a in extra]
        else:
            base = TINY
        args = parse_args(base + ["--log-loss-file", loss_file] + extra)
        session = mindspeed.adapt(args)
        try:
            run(args, session)
        finally:
            mindspeed.unadapt()
        if rank == 0:
            with open(loss_file) as f:
                losses[name] = [json.loads(line)["lm_loss"] for line in f]
            for cp in (session.part("megatron_cp_groups") or {}).values():     # the CP groups it ran on
                parts = (cp.ulysses_group, cp.ring_group) if cp.algo == "hybrid_cp_algo" else ()
                losses[name + "/built"] = ((cp.algo, cp.ulysses_degree, cp.ring_size, cp.window_size)
                                           if all(p is not None for p in parts) else "missing sub-groups")
    return losses


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("cp_training"))
    _documents(tmp)
    losses = run_distributed(_train_all, world_size=2, args=(RUNS, tmp),
                             timeout=420)[0]
    losses.update(run_distributed(_train_all, world_size=4, args=(RUNS_CP4, tmp),
                                  timeout=420)[0])
    return losses


@pytest.mark.parametrize("algo", ["eod-ring", "eod-ulysses", "eod-kvallgather"])
def test_cp_with_packed_documents_matches_cp1(losses, algo):
    """Varlen attention inside documents: CP 2 gives CP 1's losses on packed short documents."""
    assert losses[algo + "/built"] == BUILT[algo]
    want = losses["eod-cp1"]
    assert len(want) == EOD_STEPS and losses[algo] == pytest.approx(want, rel=5e-5, abs=5e-5)


def test_cp1_trains(losses):
    assert len(losses["cp1"]) == 10 and losses["cp1"][-1] < losses["cp1"][0] - 0.1


@pytest.mark.parametrize("algo", ["ulysses", "ring", "kvallgather", "ring-general-mask", "hybrid-u2xring2",
                                  "double-ring"])
def test_cp_matches_cp1_losses(losses, algo):
    assert losses[algo + "/built"] == BUILT[algo]
    want = losses["cp1"][:CP4_STEPS] if algo in RUNS_CP4 else losses["cp1"]
    assert len(losses[algo]) == len(want) and losses[algo] == pytest.approx(want, rel=5e-5, abs=5e-5)
