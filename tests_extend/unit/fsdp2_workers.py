"""The 2-process body of test_fsdp2.py (run_distributed, daemon=False: dist_checkpointing's save starts
a helper process): the torch trainer (Megatron-Core GPT, mock data) at DP 2, fp32, with DDP and with
--use-torch-fsdp2 from the same seed for 20 updates; a torch_dist save at step 10 resumed under FSDP2
and loaded into the plain (DDP) layout; what each rank holds of the parameters and optimizer states;
the same pair with --bf16 (FSDP2's MixedPrecisionPolicy against DDP's bf16 with fp32 main weights),
its save resumed under FSDP2 + bf16. fsdp2_at_tp2: 4 ranks, TP 2 x DP 2, DDP against FSDP2."""
from __future__ import annotations

import os
import time

import torch

from tests_extend.unit import swap_workers as kit

STEPS, SAVE_AT = 20, 10
BASE = ["--global-batch-size", "4", "--untie-embeddings-and-output-weights"]
FSDP2 = ["--use-torch-fsdp2"]
BF16 = ["--bf16"]
TP2 = ["--tensor-model-parallel-size", "2"]
TP2_STEPS, TP2_SAVE_AT = 4, 2


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


def _run(flags, steps, root=None, world_size=2, save_at=SAVE_AT):
    args, tr = kit.trainer_for(BASE + flags, world_size=world_size)
    it = kit.batches(args, tr)
    losses, norms, logits = [], [], set()
    tr.model[0].module.output_layer.register_forward_hook(lambda _m, _i, out: logits.add(str(out[0].dtype)))
    for step in range(1, steps + 1):
        loss, norm, _ = tr.train_step(it)
        losses.append(loss)
        norms.append(float(norm))
        if root and step == save_at:
            from mindspeed.checkpoint import torch_dist
            torch_dist.save_checkpoint(root, step, tr.model, tr.optimizer, tr.scheduler, step * 4)
    return {"losses": losses, "grad_norms": norms, "logits_dtypes": sorted(logits), **_numels(tr),
            "reduce_dtypes": _reduce_dtypes(tr)}


def _reduce_dtypes(tr) -> list:
    """The dtypes each FSDP2 layer reduce-scatters its gradients in (its MixedPrecisionPolicy's)."""
    groups = [m._get_fsdp_state()._fsdp_param_group for chunk in tr.model for m in chunk.modules()
              if hasattr(m, "_get_fsdp_state")]
    return sorted({str(g.mp_policy.reduce_dtype) for g in groups if g is not None})


def _resumed(flags, root, steps=2, world_size=2):
    from mindspeed.training import pretrain
    args, tr = kit.trainer_for(BASE + flags + ["--load", root], world_size=world_size)
    iteration, consumed = pretrain.resume(args, tr, kit._Log())
    return {"iteration": iteration, "losses": kit.train(args, tr, steps, consumed)}


def _init(rank, world_size, flags=()):
    import mindspeed
    from mindspeed.training import pretrain
    from mindspeed.flags.trainer_flags import parse_args
    args = parse_args(kit.TINY + BASE + list(flags), world_size=world_size)
    mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain.init_batch_schedule(args, rank)


def fsdp2_against_ddp(rank, world_size, root):
    import mindspeed
    _init(rank, world_size)
    saved, saved_bf16 = os.path.join(root, "fsdp2"), os.path.join(root, "fsdp2_bf16")
    out = {"ddp": _run([], STEPS), "fsdp2": _run(FSDP2, STEPS, saved),
           "distributed_optimizer": _numels(kit.trainer_for(BASE + ["--use-distributed-optimizer"], world_size=2)[1])}
    out["resumed_fsdp2"] = _resumed(FSDP2, saved)
    out["resumed_plain"] = _resumed([], saved)
    out["ddp_bf16"], out["fsdp2_bf16"] = _run(BF16, STEPS), _run(FSDP2 + BF16, STEPS, saved_bf16)
    out["resumed_fsdp2_bf16"] = _resumed(FSDP2 + BF16, saved_bf16)
    mindspeed.unadapt()
    out["cpu_seconds"] = time.process_time()
    return out


def fsdp2_at_tp2(rank, world_size, root):
    """TP 2 x DP 2: Megatron-Core's wrapper shards each TP shard over its data-parallel group; a save
    after TP2_SAVE_AT updates resumed under FSDP2 and loaded into the plain layout (both TP 2)."""
    import mindspeed
    _init(rank, world_size, TP2)
    out = {"ddp": _run(TP2, TP2_STEPS, world_size=world_size),
           "fsdp2": _run(TP2 + FSDP2, TP2_STEPS, root, world_size, save_at=TP2_SAVE_AT)}
    out["resumed_fsdp2"] = _resumed(TP2 + FSDP2, root, world_size=world_size)
    out["resumed_plain"] = _resumed(TP2, root, world_size=world_size)
    mindspeed.unadapt()
    return dict(out, cpu_seconds=time.process_time())
