"""The 2-process body of test_fsdp2.py (run_distributed, daemon=False: dist_checkpointing's save starts
a helper process): the torch trainer (Megatron-Core GPT, mock data) at DP 2, fp32, with DDP and with
--use-torch-fsdp2 from the same seed for 20 updates; a torch_dist save at step 10 resumed under FSDP2
and loaded into the plain (DDP) layout; what each rank holds of the parameters and optimizer states."""
from __future__ import annotations

import os
import time

import torch

from tests_extend.unit import swap_workers as kit

STEPS, SAVE_AT = 20, 10
BASE = ["--global-batch-size", "4", "--untie-embeddings-and-output-weights"]
FSDP2 = ["--use-torch-fsdp2"]


def _numels(tr) -> dict:
    """Elements this rank holds: parameters (their local shards) and optimizer states."""
    from megatron.core.utils import to_local_if_dtensor
    params = [p for chunk in tr.model for p in chunk.parameters()]
    states = [t for opt in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
              for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"params_local": sum(to_local_if_dtensor(p).numel() for p in params),
            "params_global": sum(p.numel() for p in params),
            "optimizer_state": sum(to_local_if_dtensor(t).numel() for t in states),
            "dtensor_params": sum(type(p).__name__ == "DTensor" for p in params), "params": len(params)}


def _run(flags, steps, root=None):
    args, tr = kit.trainer_for(BASE + flags, world_size=2)
    it = kit.batches(args, tr)
    losses, norms = [], []
    for step in range(1, steps + 1):
        loss, norm, _ = tr.train_step(it)
        losses.append(loss)
        norms.append(float(norm))
        if root and step == SAVE_AT:
            from mindspeed.checkpoint import torch_dist
            torch_dist.save_checkpoint(root, step, tr.model, tr.optimizer, tr.scheduler, step * 4)
    return {"losses": losses, "grad_norms": norms, **_numels(tr)}


def _resumed(flags, root, steps=2):
    from mindspeed.training import pretrain
    args, tr = kit.trainer_for(BASE + flags + ["--load", root], world_size=2)
    iteration, consumed = pretrain.resume(args, tr, kit._Log())
    return {"iteration": iteration, "losses": kit.train(args, tr, steps, consumed)}


def fsdp2_against_ddp(rank, world_size, root):
    import mindspeed
    from mindspeed.training import pretrain
    from mindspeed.flags.trainer_flags import parse_args
    args = parse_args(kit.TINY + BASE, world_size=world_size)
    mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain.init_batch_schedule(args, rank)
    saved = os.path.join(root, "fsdp2")
    out = {"ddp": _run([], STEPS), "fsdp2": _run(FSDP2, STEPS, saved),
           "distributed_optimizer": _numels(kit.trainer_for(BASE + ["--use-distributed-optimizer"], world_size=2)[1])}
    out["resumed_fsdp2"] = _resumed(FSDP2, saved)
    out["resumed_plain"] = _resumed([], saved)
    mindspeed.unadapt()
    out["cpu_seconds"] = time.process_time()
    return out
