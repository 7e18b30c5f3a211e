"""The distributed-optimizer parity experiment (test_mindspore_parity_zero.py and its msrun worker):
mindspore_parity's GPT, weights and optimizer settings at DP=2, each DP rank on its own micro-batch
(rank r of step s trains on batch(2 s + r)); torch side: Megatron-Core's GPTModel with
torch.optim.AdamW on the DP-averaged gradients, MindSpore side: the trainer with
--use-distributed-optimizer (ZeRO-1) under msrun."""
from __future__ import annotations

import numpy as np

from tests_extend.distributed import mindspore_parity as mp


def micro_batch(step: int, dp_rank: int, dp_size: int):
    return mp.batch(dp_size * step + dp_rank)


# -- mindspore side ------------------------------------------------------------------------------
def ms_run(backend, init_ckpt: str, *, flag: bool = True, tp: int = 1, steps: int = mp.STEPS, load: str | None = None,
           save_dir: str | None = None, save_at: int | None = None, extra: tuple = ()) -> dict:
    """Train `steps` steps from init_ckpt (or from checkpoint `load`, its moments and iteration
    included), through mindspeed.adapt (the support matrix gates the flag); save at step save_at."""
    import mindspeed
    from mindspeed.backends import get_backend
    from mindspeed.flags.trainer_flags import parse_args
    world = backend.comm.world_size()
    dp = world // tp
    argv = mp.trainer_argv(tp) + ["--global-batch-size", str(mp.MBS * dp)] + (
        ["--use-distributed-optimizer"] if flag else []) + list(extra)
    args = parse_args(argv, world_size=world)
    args.backend = "mindspore"
    mindspeed.adapt(args)
    try:
        return _ms_run(get_backend(), args, tp, init_ckpt, steps, load, save_dir, save_at)
    finally:
        mindspeed.unadapt()


def _ms_run(backend, args, tp, init_ckpt, steps, load, save_dir, save_at):
    from mindspeed.training.mindspore import checkpoint
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.optimizer import Adam
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    ps = build_parallel_state(backend.comm, tp)
    trainer = Trainer(args, backend, ps, GPTConfig.from_args(args, mp.VOCAB))
    meta = checkpoint.load(load or init_ckpt, trainer.model, trainer.optimizer, load_optimizer=load is not None)
    start = int(meta["iteration"]) if load else 0
    losses, norms = [], []
    for step in range(start, start + steps):
        tokens, labels, mask = micro_batch(step, ps.dp_rank, ps.dp_size)
        loss, norm, _ = trainer.train_step([{"tokens": tokens, "labels": labels, "loss_mask": mask}], step + 1)
        losses.append(loss)
        norms.append(norm)
        if save_at == step + 1:
            checkpoint.save(backend, ps, save_dir, step + 1, trainer.model, trainer.optimizer, {"backend": "mindspore"})
    out = {"losses": losses, "grad_norms": norms, "graph_mode": trainer.graph_mode,
           "distributed": trainer.distributed_optimizer}
    if trainer.distributed_optimizer:    # this rank's moments vs the plain Adam's on the same model
        plain = Adam(trainer.model, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        out["state_elements"] = trainer.optimizer.state_elements()
        out["plain_state_elements"] = sum(int(a.size) for a in plain.state_arrays().values())
    return out


# -- torch side (gloo harness) -------------------------------------------------------------------
def torch_train_dp(rank, world_size, init_ckpt):
    """DP=world_size: AdamW on the gradients averaged over DP; the logged loss is the DP mean."""
    import torch
    import mindspeed
    mindspeed.adapt([])
    from megatron.core import parallel_state
    from tests_extend import megatron_tiny
    megatron_tiny.init_parallel(tp=1)
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    dp_group = parallel_state.get_data_parallel_group()
    model = mp.build_torch_model(1)
    mp.load_into_torch(model, init_ckpt, 0, 1)
    params = [p for _, p in model.named_parameters()]
    opt = mp.megatron_adamw(params)
    losses, norms = [], []
    for step in range(mp.STEPS):
        for group in opt.param_groups:
            group["lr"] = mp.lr_at(step)
        opt.zero_grad()
        loss = mp._torch_loss(model, dp * step + dp_rank)
        loss.backward()
        for p in params:
            torch.distributed.all_reduce(p.grad, group=dp_group)
            p.grad.div_(dp)
        norms.append(float(sum(p.grad.double().square().sum() for p in params).sqrt()))
        mp.clip_like_megatron(params, norms[-1])
        opt.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=dp_group)
        losses.append(float(mean) / dp)
    with torch.no_grad():        # the trained weights' loss on the held-out batch
        eval_loss = float(mp._torch_loss(model, mp.EVAL_SEED))
    return {"losses": losses, "grad_norms": norms, "eval_loss": eval_loss}
