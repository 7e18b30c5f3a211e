"""The 2-process body of test_optimizer_dp2.py (run_distributed, daemon=False: dist_checkpointing's save
starts a helper process): the torch trainer (Megatron-Core GPT, mock data) at data-parallel size 2 with

- --optimizer-selection fused_ema_adamw under --bf16 --use-distributed-optimizer: each rank's EMA shards
  against an fp64 (numpy) AdamW + EMA of the same shards over STEPS updates; --use-ema validation (the EMA
  all-gathered into the model, the weights back after); a torch_dist save resumed;
- --quant-grads with SGD over two micro-batches per rank against fp32 gradients (the per-parameter
  scales agreed over the two ranks before the reduction)."""
from __future__ import annotations

import os
import time

import torch

from tests_extend.unit import ema_adamw_worker as ema_kit
from tests_extend.unit import swap_workers as kit

# CI's time budget: 6 updates; the 20 where MINDSPEED_SLOW_TESTS=1 (the bounds scale with them)
STEPS, HALF = (20 if os.environ.get("MINDSPEED_SLOW_TESTS") else 6), 3
EMA = ema_kit.EMA + ["--use-ema", "--bf16", "--use-distributed-optimizer", "--global-batch-size", "4", "--eval-iters", "2"]
SGD = ["--optimizer", "sgd", "--global-batch-size", "8"]          # micro-batch 2: two per rank


def _ema_shards(tr) -> list:
    return [s[ema_kit.ema_adamw_megatron.KEY].clone() for inner in ema_kit.inner_optimizers(tr) for s in inner.state.values()]


def _own_shard_is_the_ema(tr) -> bool:
    """Inside ema_weights: this rank's range of every model parameter is its EMA shard (as bf16)."""
    (opt,) = ema_kit.megatron_optimizers(tr)
    ok = True
    for model_group, shard_group in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
        for model_param, shard in zip(model_group, shard_group):
            span = opt._get_model_param_range_map(model_param)["param"]
            ema = opt.optimizer.state[shard][ema_kit.ema_adamw_megatron.KEY]
            ok &= torch.equal(model_param.detach().view(-1)[span.start:span.end], ema.to(model_param.dtype))
    return bool(ok)


def ema_against_numpy(root: str) -> dict:
    from megatron.core import parallel_state
    from mindspeed.training import pretrain
    args, tr, session = kit.trainer_and_session(EMA, world_size=2)
    tr.ema_weights = session.part("ema_weights")
    (inner,) = ema_kit.inner_optimizers(tr)
    rec = ema_kit.Recorder(inner)
    losses = kit.train(args, tr, STEPS)
    out = {"losses": losses, "gaps": ema_kit.reference(rec, 0.6),
           "shard_elements": sum(p.numel() for p in rec.params),
           "model_elements": sum(p.numel() for p in tr.model[0].parameters())}
    weights = [p.detach().clone() for p in tr.model[0].parameters()]
    with ema_kit.ema_adamw_megatron.ema_weights([tr.optimizer]):
        out["own_shard_is_ema"] = _own_shard_is_the_ema(tr)
        out["ema_model_checksum"] = sum(float(p.detach().double().sum()) for p in tr.model[0].parameters())
    out["restored"] = all(torch.equal(a, b) for a, b in zip(weights, tr.model[0].parameters()))
    ds = kit.dataset(args)
    out["with_ema"] = tr.evaluate(ds)
    out["plain"] = pretrain.validation_loss(args, tr.model, ds, tr.reader, tr.num_microbatches)
    out["dp_rank"] = parallel_state.get_data_parallel_rank()
    out["resume"] = ema_resumed(root)
    return out


def ema_resumed(root: str) -> dict:
    from mindspeed.checkpoint import torch_dist
    from mindspeed.training import pretrain
    path = os.path.join(root, "ema_distributed")
    args, tr = kit.trainer_for(EMA, world_size=2)
    it = kit.batches(args, tr)
    for _ in range(HALF):
        tr.train_step(it)
    consumed = HALF * args.global_batch_size
    torch_dist.save_checkpoint(path, HALF, tr.model, tr.optimizer, tr.scheduler, consumed)
    saved = _ema_shards(tr)
    continued = [tr.train_step(it)[0] for _ in range(HALF)]
    final = _ema_shards(tr)
    args2, tr2 = kit.trainer_for(EMA + ["--load", path], world_size=2)
    pretrain.resume(args2, tr2, kit._Log())
    loaded = _ema_shards(tr2)
    resumed = kit.train(args2, tr2, HALF, consumed)
    return {"continued": continued, "resumed": resumed,
            "loaded_bitwise": len(loaded) == len(saved) > 0 and all(map(torch.equal, loaded, saved)),
            "final_bitwise": all(map(torch.equal, _ema_shards(tr2), final))}


def quant_grads_sgd() -> dict:
    out = {}
    for name, flags in (("fp32", SGD), ("quant", SGD + ["--quant-grads"])):
        args, tr = kit.trainer_for(flags, world_size=2)
        it = kit.batches(args, tr)
        largest = 0.0
        for _ in range(STEPS):
            tr.train_step(it)
            largest = max([largest] + [float(p.grad.abs().max()) for g in tr.optimizer.optimizer.param_groups
                                       for p in g["params"] if p.grad is not None])
        buckets = [b for chunk in tr.model for buf in chunk.buffers for b in buf.buckets]
        out[name] = {"weights": [p.detach().clone() for p in tr.model[0].parameters()], "largest_grad": largest,
                     "lr": args.lr, "scales": [s for b in buckets for s in getattr(b, "quant_grad_scales", torch.zeros(0)).tolist()]}
    gap = max(float((a - b).abs().max()) for a, b in zip(out["quant"].pop("weights"), out["fp32"].pop("weights")))
    return {"weight_gap": gap, **out}


def dp2_optimizers(rank, world_size, root):
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training import pretrain
    args = parse_args(kit.TINY, world_size=world_size)
    mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain.init_batch_schedule(args, rank)
    out = {"ema": ema_against_numpy(root), "quant_grads": quant_grads_sgd()}
    mindspeed.unadapt()
    out["cpu_seconds"] = time.process_time()
    return out
