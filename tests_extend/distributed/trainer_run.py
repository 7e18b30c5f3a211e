"""One run of the built-in torch trainer inside a distributed test body, its losses read back."""
import json
import os

from tests_extend.distributed.harness import next_rendezvous


def train(rank: int, argv: list, tmp: str, name: str):
    """Train `argv` (a fresh rendezvous first: each run builds its own process groups); rank 0 gets the
    loss of every iteration, the other ranks None."""
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.pretrain import run
    loss_file = os.path.join(tmp, f"{name}.jsonl")
    next_rendezvous(rank, loss_file + ".port")
    args = parse_args(argv + ["--log-loss-file", loss_file])
    session = mindspeed.adapt(args)
    try:
        run(args, session)
    finally:
        mindspeed.unadapt()
    if rank != 0:
        return None
    with open(loss_file) as f:
        return [json.loads(line)["lm_loss"] for line in f]
