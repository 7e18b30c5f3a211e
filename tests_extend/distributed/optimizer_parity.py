"""The optimizer parity experiment (test_mindspore_parity_optimizers.py): mindspore_parity's GPT,
weights and batches, trained with --optimizer sgd and a WSD learning-rate schedule.

torch side: Megatron-Core's GPTModel with the optimizer Megatron-Core builds for --optimizer sgd
(its own param groups, torch.optim.SGD(lr, weight_decay, momentum)), driven by Megatron-Core's
own OptimizerParamScheduler, and Megatron's clipping rule. MindSpore side: the MindSpore trainer,
its flags passed through the support matrix (mindspeed.adapt) as the trainer does.
"""
from __future__ import annotations

from tests_extend.distributed import mindspore_parity as mp

STEPS = 20
# an lr SGD moves at (Adam's 5e-3 would leave it nearly still), a momentum other than the default,
# and a WSD decay over the last 8 of 20 iterations (from iteration 12 on)
SGD = dict(lr=0.2, min_lr=0.02, warmup=2, momentum=0.8, weight_decay=0.1, wsd_iters=8, wsd_style="cosine")


def extra_flags() -> list:
    return ["--optimizer", "sgd", "--sgd-momentum", str(SGD["momentum"]), "--lr", str(SGD["lr"]),
            "--min-lr", str(SGD["min_lr"]), "--lr-warmup-iters", str(SGD["warmup"]),
            "--weight-decay", str(SGD["weight_decay"]), "--lr-decay-style", "WSD",
            "--lr-wsd-decay-iters", str(SGD["wsd_iters"]), "--lr-wsd-decay-style", SGD["wsd_style"]]


# -- mindspore side ------------------------------------------------------------------------------
def _ms_trainer(backend, init_ckpt):
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore import checkpoint
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    args = parse_args(mp.trainer_argv(1) + extra_flags(), world_size=1)
    ps = build_parallel_state(backend.comm, 1, False, 1)
    trainer = Trainer(args, backend, ps, GPTConfig.from_args(args, mp.VOCAB))
    checkpoint.load(init_ckpt, trainer.model)
    return trainer


def _steps(trainer, first: int, last: int) -> dict:
    losses, norms, lrs = [], [], []
    for step in range(first, last):
        tokens, labels, mask = mp.batch(step)
        loss, norm, lr = trainer.train_step([{"tokens": tokens, "labels": labels, "loss_mask": mask}], step + 1)
        losses.append(loss)
        norms.append(norm)
        lrs.append(lr)
    return {"losses": losses, "grad_norms": norms, "lrs": lrs}


def ms_train(init_ckpt: str, ckpt_dir: str, resume_at: int) -> dict:
    """STEPS steps (checkpoint at `resume_at`), then the steps after `resume_at` again from that
    checkpoint in a fresh trainer: the momentum must come back for the losses to repeat."""
    import mindspeed
    from mindspeed.backends import get_backend
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore import checkpoint
    gate = parse_args(mp.trainer_argv(1) + extra_flags(), world_size=1)
    gate.backend = "mindspore"
    mindspeed.adapt(gate)      # the support matrix (the one gate) must accept these flags
    try:
        backend = get_backend()
        trainer = _ms_trainer(backend, init_ckpt)
        result = _steps(trainer, 0, resume_at)
        checkpoint.save(backend, trainer.ps, ckpt_dir, resume_at, trainer.model, trainer.optimizer,
                        {"backend": "mindspore"})
        rest = _steps(trainer, resume_at, STEPS)
        result = {k: result[k] + rest[k] for k in result}
        result["graph_mode"] = trainer.graph_mode
        resumed = _ms_trainer(backend, init_ckpt)
        checkpoint.load(ckpt_dir, resumed.model, resumed.optimizer)
        result["resumed_losses"] = _steps(resumed, resume_at, STEPS)["losses"]
        return result
    finally:
        mindspeed.unadapt()


# -- torch side (inside the gloo harness) --------------------------------------------------------
def torch_train(rank, world_size, init_ckpt):
    """Writes the initial weights to init_ckpt, then trains STEPS steps."""
    import numpy as np
    import torch
    import mindspeed
    mindspeed.adapt([])
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from tests_extend import megatron_tiny
    megatron_tiny.init_parallel(tp=1)
    model = mp.build_torch_model(1)
    mp.save_torch_init(model, init_ckpt)
    config = OptimizerConfig(optimizer="sgd", lr=SGD["lr"], min_lr=SGD["min_lr"], weight_decay=SGD["weight_decay"],
                             sgd_momentum=SGD["momentum"], clip_grad=mp.OPT["clip"])
    # what get_megatron_optimizer builds for --optimizer sgd (its fp32, non-distributed branch)
    opt = torch.optim.SGD(_get_param_groups([model], config, None), lr=config.lr,
                          weight_decay=config.weight_decay, momentum=config.sgd_momentum)
    scheduler = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=SGD["lr"], min_lr=SGD["min_lr"], lr_warmup_steps=SGD["warmup"],
        lr_decay_steps=STEPS, lr_decay_style="WSD", start_wd=SGD["weight_decay"], end_wd=SGD["weight_decay"],
        wd_incr_steps=STEPS, wd_incr_style="constant", wsd_decay_steps=SGD["wsd_iters"],
        lr_wsd_decay_style=SGD["wsd_style"])
    params = [p for _, p in model.named_parameters()]
    losses, norms, lrs = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = mp._torch_loss(model, step)
        loss.backward()
        norms.append(float(np.sqrt(sum(float(p.grad.double().square().sum()) for p in params))))
        mp.clip_like_megatron(params, norms[-1])
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step(1)
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms, "lrs": lrs}
