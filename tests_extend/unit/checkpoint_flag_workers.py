"""Run in a fresh process for the checkpoint-flag tests (a plain process, not the multiprocessing
harness: dist_checkpointing's save starts a helper process, which a daemon may not):

    python -m tests_extend.unit.checkpoint_flag_workers ROOT   -> one JSON line on stdout

the torch trainer's resume (pretrain.resume) with --no-load-optim / --no-load-rng / --finetune."""
from __future__ import annotations

import json
import random
import sys

import numpy as np
import torch

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "8", "--lr", "1e-2",
        "--mock-data", "--tensor-model-parallel-size", "1"]


class _Log:
    def print(self, *_):
        pass


def _moments(optimizer) -> float:
    """Sum of |Adam exp_avg| over every parameter: 0 for an optimizer that never stepped or loaded."""
    total = 0.0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if "exp_avg" in state:
                total += float(state["exp_avg"].abs().sum())
    return total


def _weights(trainer) -> float:
    return float(sum(p.detach().double().abs().sum() for p in trainer.model[0].parameters()))


def _rng_states():
    return (torch.get_rng_state().clone(), np.random.get_state()[1].copy(), random.getstate())


def _same_rng(a, b) -> bool:
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def torch_resume_report(root: str) -> dict:
    """Train one optimizer step, save at iteration 1, then resume fresh trainers with each flag."""
    import mindspeed
    from mindspeed.training import pretrain
    from mindspeed.flags.trainer_flags import parse_args

    def trainer_for(*flags):
        args = parse_args(TINY + list(flags), world_size=1)
        args.device_name = "cpu"
        args.vocab_size, args.padded_vocab_size = 60, 128
        return args, pretrain.Trainer(args, _Log())

    args = parse_args(TINY, world_size=1)
    mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain._set_seeds(args)
    args, trainer = trainer_for()
    for chunk in trainer.model:
        for p in chunk.parameters():
            p.main_grad.copy_(torch.full_like(p, 0.01))
    trainer.optimizer.step()
    from mindspeed.checkpoint import torch_dist as checkpointing
    checkpointing.save_checkpoint(root, 1, trainer.model, trainer.optimizer, trainer.scheduler, 2)
    saved = {"moments": _moments(trainer.optimizer), "weights": _weights(trainer),
             "lr": trainer.optimizer.param_groups[0]["lr"]}

    report = {"saved": saved}
    for name, flags in (("default", []), ("no_load_optim", ["--no-load-optim"]),
                        ("no_load_rng", ["--no-load-rng"]), ("finetune", ["--finetune"])):
        args, fresh = trainer_for("--load", root, *flags)
        torch.manual_seed(4321)
        np.random.seed(4321)
        random.seed(4321)
        before = _rng_states()
        iteration, consumed = pretrain.resume(args, fresh, _Log())
        report[name] = {"iteration": iteration, "consumed": consumed, "moments": _moments(fresh.optimizer),
                        "weights": _weights(fresh), "rng_untouched": _same_rng(before, _rng_states())}
    report["no_save_optim"] = _no_save_optim(root + "-weights-only", trainer, trainer_for)
    return report


def _no_save_optim(root: str, trainer, trainer_for) -> dict:
    """--no-save-optim's checkpoint (as pretrain's save writes it): a resume that wants the optimizer
    state is refused in one line, --no-load-optim resumes."""
    from mindspeed.checkpoint import torch_dist as checkpointing
    from mindspeed.errors import CheckpointError
    from mindspeed.training import pretrain
    checkpointing.save_checkpoint(root, 1, trainer.model, None, trainer.scheduler, 2, extra={"no_optimizer": True})
    out = {"refused": None}
    args, fresh = trainer_for("--load", root)
    try:
        pretrain.resume(args, fresh, _Log())
    except CheckpointError as err:
        out["refused"] = str(err)
    args, fresh = trainer_for("--load", root, "--no-load-optim")
    out["no_load_optim"] = list(pretrain.resume(args, fresh, _Log()))
    return out


if __name__ == "__main__":
    print(json.dumps(torch_resume_report(sys.argv[1])))
