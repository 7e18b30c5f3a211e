"""Run in a fresh process for test_ema_adamw.py (dist_checkpointing's save starts a helper process,
which a multiprocessing daemon may not):

    python -m tests_extend.unit.ema_adamw_worker ROOT   -> one JSON line on stdout

The torch trainer (Megatron-Core GPT, Megatron's optimizers, mock data) with
--optimizer-selection fused_ema_adamw against --optimizer adam; the gradients, learning rates and
weights of every update, for an fp64 reference; checkpoints saved mid-run in both formats and
resumed; validation with --use-ema."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

from mindspeed.features.training import ema_adamw_megatron
from tests_extend.unit import swap_workers as kit

STEPS = 20
ONE_MICRO_BATCH = ["--global-batch-size", "2", "--eval-iters", "2"]
# decay 0.6: upstream's warm-up (1 + t) / (10 + t) is below it up to update 12, above it after
EMA = ["--optimizer-selection", "fused_ema_adamw", "--ema-decay", "0.6"]


def megatron_optimizers(tr) -> list:
    return getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])


def inner_optimizers(tr) -> list:
    return [o.optimizer for o in megatron_optimizers(tr)]


class Recorder:
    """Each update's inputs (gradient, lr, weight decay) and outputs (weights, EMA) per parameter."""

    def __init__(self, inner):
        self.inner, self.steps = inner, []
        self.params = [p for g in inner.param_groups for p in g["params"]]
        self.initial = [p.detach().double().numpy().copy() for p in self.params]
        inner.register_step_pre_hook(lambda *_: self.before())
        inner.register_step_post_hook(lambda *_: self.after())

    def before(self):
        groups = {id(p): g for g in self.inner.param_groups for p in g["params"]}
        self.steps.append({"grad": [p.grad.double().numpy().copy() for p in self.params],
                           "lr": [groups[id(p)]["lr"] for p in self.params],
                           "wd": [groups[id(p)]["weight_decay"] for p in self.params],
                           "betas": groups[id(self.params[0])]["betas"], "eps": groups[id(self.params[0])]["eps"]})

    def after(self):
        step = self.steps[-1]
        step["param"] = [p.detach().double().numpy().copy() for p in self.params]
        step["ema"] = [self.inner.state[p]["ema_params"].double().numpy().copy()
                       if "ema_params" in self.inner.state[p] else None for p in self.params]


def max_rel(a, b) -> float:
    return max(float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)) for x, y in zip(a, b))


def reference(rec: Recorder, decay: float) -> dict:
    """fp64 AdamW (torch's decoupled weight decay) from the recorded gradients, and the EMA of
    (a) the reference weights and (b) the run's own fp32 weights; largest relative gaps to the run."""
    w = list(rec.initial)
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    ema_ref, ema_of_run = list(rec.initial), list(rec.initial)
    gaps = {"param": 0.0, "ema": 0.0, "ema_of_run_weights": 0.0}
    for t, step in enumerate(rec.steps, start=1):
        b1, b2 = step["betas"]
        d = min(decay, (1 + t) / (10 + t))
        for i, g in enumerate(step["grad"]):
            lr, wd = step["lr"][i], step["wd"][i]
            w[i] = w[i] * (1 - lr * wd)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            denom = np.sqrt(v[i]) / np.sqrt(1 - b2 ** t) + step["eps"]
            w[i] = w[i] - lr / (1 - b1 ** t) * m[i] / denom
            ema_ref[i] = d * ema_ref[i] + (1 - d) * w[i]
            ema_of_run[i] = d * ema_of_run[i] + (1 - d) * step["param"][i]
        gaps["param"] = max(gaps["param"], max_rel(step["param"], w))
        gaps["ema"] = max(gaps["ema"], max_rel(step["ema"], ema_ref))
        gaps["ema_of_run_weights"] = max(gaps["ema_of_run_weights"], max_rel(step["ema"], ema_of_run))
    return gaps


def against_reference(flags: list, decay: float) -> dict:
    out = {}
    for name, extra in (("adam", []), ("ema", EMA)):
        args, tr = kit.trainer_for(flags + extra + ONE_MICRO_BATCH)
        (inner,) = inner_optimizers(tr)
        rec = Recorder(inner)
        out[name] = {"losses": kit.train(args, tr, STEPS),
                     "weights": [p.detach().double().sum().item() for p in rec.params],
                     "ema_updates": sum(getattr(o, "mindspeed_ema", None).updates for o in megatron_optimizers(tr)
                                        if hasattr(o, "mindspeed_ema")),
                     "state_keys": sorted({k for s in inner.state.values() for k in s})}
        if name == "ema":
            out["gaps"] = reference(rec, decay)
            out["ema_bytes_per_param"] = (sum(s["ema_params"].numel() * s["ema_params"].element_size()
                                              for s in inner.state.values()) / sum(p.numel() for p in rec.params))
    return out


def ema_state(tr) -> list:
    return [s["ema_params"].clone() for inner in inner_optimizers(tr) for s in inner.state.values()]


def resumed(root: str, fmt: str, flags: list, half: int = 4) -> dict:
    """Train `half` updates, save in `fmt`, train `half` more; a new trainer loads the checkpoint
    and trains `half`: the two continuations (losses, EMA) and what the checkpoint holds."""
    from mindspeed.checkpoint import legacy, torch_dist
    from mindspeed.training import pretrain
    path = os.path.join(root, fmt + "_" + "_".join(flags))
    all_flags = flags + EMA + ONE_MICRO_BATCH + ["--ckpt-format", fmt]
    args, tr = kit.trainer_for(all_flags)
    it = kit.batches(args, tr)
    for _ in range(half):
        tr.train_step(it)
    consumed = half * args.global_batch_size
    if fmt == "torch":
        legacy.save_checkpoint(path, half, tr.model, tr.optimizer, tr.scheduler, consumed, args=args)
    else:
        torch_dist.save_checkpoint(path, half, tr.model, tr.optimizer, tr.scheduler, consumed)
    saved_ema = ema_state(tr)
    with ema_adamw_megatron.ema_weights([tr.optimizer]):     # the model holding its EMA (as its dtype)
        ema_in_model = [p.detach().clone() for p in tr.model[0].parameters()]
    continued = [tr.train_step(it)[0] for _ in range(half)]
    ema_continued = ema_state(tr)
    args2, tr2 = kit.trainer_for(all_flags + ["--load", path])
    pretrain.resume(args2, tr2, kit._Log())
    loaded_ema = ema_state(tr2)
    again = kit.train(args2, tr2, half, consumed)
    ema_again = ema_state(tr2)
    return {"continued": continued, "resumed": again, "use_ema_load": use_ema_load(all_flags, path, ema_in_model),
            "loaded_ema_bitwise": len(loaded_ema) == len(saved_ema) > 0
            and all(torch.equal(a, b) for a, b in zip(loaded_ema, saved_ema)),
            "final_ema_bitwise": all(torch.equal(a, b) for a, b in zip(ema_again, ema_continued)),
            "on_disk": state_keys_on_disk(path, half, fmt)}


def use_ema_load(flags: list, path: str, ema_in_model: list) -> dict:
    """What mindspeed.generate / evaluate --use-ema load (checkpoint.ema_weights) into a fresh model:
    tensors loaded, and whether the model then holds the saved run's EMA bit for bit; or the refusal."""
    from mindspeed.checkpoint import ema_weights
    from mindspeed.errors import CheckpointError
    _args, tr = kit.trainer_for(flags)
    try:
        count = ema_weights.load_ema_weights(path, tr.model)
    except CheckpointError as err:
        return {"refused": str(err)}
    loaded = list(tr.model[0].parameters())
    return {"tensors": count, "params": len(loaded),
            "bitwise": len(loaded) == len(ema_in_model) and all(torch.equal(a, b) for a, b in zip(loaded, ema_in_model))}


def state_keys_on_disk(path: str, iteration: int, fmt: str) -> dict:
    """How many 'ema_params' and 'exp_avg' tensors the files hold (read back from disk)."""
    directory = os.path.join(path, f"iter_{iteration:07d}")
    if fmt == "torch":
        from mindspeed.checkpoint import legacy
        (rank_dir,) = os.listdir(directory)
        state = legacy.read_file(os.path.join(directory, rank_dir, "model_optim_rng.pt"))
        saved = state["optimizer"]
        inner = saved.get("optimizer", saved)      # Float16Optimizer nests the torch optimizer's dict
        return {key: sum(key in s for s in inner["state"].values()) for key in ("ema_params", "exp_avg")}
    from megatron.core.dist_checkpointing.serialization import load_tensors_metadata
    keys = list(load_tensors_metadata(directory))
    return {key: sum(f".{key}." in k for k in keys) for key in ("ema_params", "exp_avg")}


def use_ema_validation() -> dict:
    """--use-ema's validation loss against the same loss with the EMA copied into the model by hand,
    the plain validation loss, and whether the model has its own weights back after."""
    from mindspeed.training import pretrain
    args, tr, session = kit.trainer_and_session(EMA + ONE_MICRO_BATCH + ["--use-ema"])
    tr.ema_weights = session.part("ema_weights")
    kit.train(args, tr, 4)
    ds = kit.dataset(args)
    weights = [p.detach().clone() for p in tr.model[0].parameters()]
    with_ema = tr.evaluate(ds)
    restored = all(torch.equal(a, b) for a, b in zip(weights, tr.model[0].parameters()))
    plain = pretrain.validation_loss(args, tr.model, ds, tr.reader, tr.num_microbatches)
    (inner,) = inner_optimizers(tr)
    with torch.no_grad():
        for p in tr.model[0].parameters():
            p.copy_(inner.state[p]["ema_params"])
    by_hand = pretrain.validation_loss(args, tr.model, ds, tr.reader, tr.num_microbatches)
    return {"with_ema": with_ema, "plain": plain, "by_hand": by_hand, "restored": restored}


def main(root: str) -> dict:
    import mindspeed
    kit.start_world_of_one()
    report = {"fp32": against_reference([], 0.6), "bf16": against_reference(["--bf16"], 0.6),
              "use_ema": use_ema_validation(),
              "resume": {f"{fmt} {' '.join(flags)}": resumed(root, fmt, flags)
                         for fmt, flags in (("torch_dist", []), ("torch", []), ("torch_dist", ["--bf16"]))}}
    mindspeed.unadapt()
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
