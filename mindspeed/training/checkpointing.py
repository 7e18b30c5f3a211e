"""Checkpoints through megatron.core.dist_checkpointing (torch_dist format: sharded, reshardable,
no pickled code on load; common state is read with torch.load's default weights_only=True).

Layout (Megatron's): <dir>/latest_checkpointed_iteration.txt and <dir>/iter_0000010/...
Everything written here is files 0640 / directories 0750.
"""
from __future__ import annotations

import os

import torch
from megatron.core import dist_checkpointing

from mindspeed.training.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
FILE_MODE, DIR_MODE = 0o640, 0o750


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str, step: int | None = None) -> int:
    """The iteration to load: `step` when given, else the one recorded in
    <root>/latest_checkpointed_iteration.txt; clear errors otherwise."""
    if not os.path.isdir(root):
        raise CheckpointError(f"--load path {root!r} does not exist or is not a directory")
    if step is not None:
        if not os.path.isdir(iteration_dir(root, step)):
            raise CheckpointError(f"--ckpt-step {step}: {iteration_dir(root, step)} does not exist")
        return step
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"--load path {root!r} holds no {TRACKER}: not a checkpoint directory "
                              "written by --save")
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} should hold an iteration number, found {text[:40]!r}")
    iteration = int(text)
    if not os.path.isdir(iteration_dir(root, iteration)):
        raise CheckpointError(f"{tracker} names iteration {iteration} but {iteration_dir(root, iteration)} "
                              "is missing")
    return iteration


def _restrict_permissions(path: str) -> None:
    for dirpath, dirnames, filenames in os.walk(path):
        os.chmod(dirpath, DIR_MODE)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), FILE_MODE)


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _model_keys(chunks) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _init_empty_distributed_optimizer_state(optimizer) -> None:
    """Without Apex/TE, DistributedOptimizer.state_dict() needs Adam's 'step' to exist before a
    load; a dummy zero-grad step creates the state that the checkpoint then overwrites."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer) -> None:
    """Without Apex/TE, Megatron's DistributedOptimizer keeps Adam's 'step' in the checkpoint's
    param_groups, but its load leaves the per-parameter torch 'step' at the value of the dummy
    state (and, where it does set it, shares one tensor among all parameters, which torch then
    advances once per parameter). Give every parameter its own step from its group."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        for group in opt.optimizer.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = opt.optimizer.state.get(param)
                if state and isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


def _sharded_state(chunks, optimizer, is_loading: bool) -> dict:
    state = {key: _unwrap(chunk).sharded_state_dict() for key, chunk in zip(_model_keys(chunks), chunks)}
    if optimizer is not None:
        if is_loading:
            _init_empty_distributed_optimizer_state(optimizer)
        # dp_reshardable: Megatron-LM's default (the flattened 'fully_sharded_model_space' format
        # is rejected by dist_checkpointing 0.16)
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    return state


def save_checkpoint(root: str, iteration: int, chunks, optimizer, scheduler, consumed_samples: int) -> str:
    rank0 = torch.distributed.get_rank() == 0
    path = iteration_dir(root, iteration)
    if rank0:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    torch.distributed.barrier()
    state = _sharded_state(chunks, optimizer, is_loading=False)
    state.update(iteration=iteration, consumed_train_samples=consumed_samples,
                 opt_param_scheduler=scheduler.state_dict(), checkpoint_version=3.0)
    dist_checkpointing.save(state, path)
    torch.distributed.barrier()
    if rank0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
        _restrict_permissions(root)
    torch.distributed.barrier()
    return path


def load_checkpoint(root: str, chunks, optimizer, scheduler, *, load_optim: bool = True,
                    finetune: bool = False, step: int | None = None) -> tuple[int, int]:
    """Load into chunks/optimizer/scheduler in place; return (iteration, consumed samples)."""
    iteration = read_tracker(root, step)
    path = iteration_dir(root, iteration)
    use_optim = load_optim and not finetune
    state = _sharded_state(chunks, optimizer if use_optim else None, is_loading=True)
    if not finetune:
        state.update(iteration=0, consumed_train_samples=0, opt_param_scheduler={}, checkpoint_version=0.0)
    try:
        loaded = dist_checkpointing.load(state, path)
    except Exception as err:   # a mismatch surfaces as many different exception types
        raise CheckpointError(f"cannot load checkpoint {path}: {type(err).__name__}: {err}") from err
    with torch.no_grad():   # main params are views of the model's parameters
        for key, chunk in zip(_model_keys(chunks), chunks):
            _unwrap(chunk).load_state_dict(loaded[key])
        if use_optim:
            optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_steps(optimizer)
    if finetune:
        return 0, 0
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    return int(loaded["iteration"]), int(loaded["consumed_train_samples"])
