"""Run in a fresh process for test_quant_states.py (dist_checkpointing's save starts a helper process,
which a multiprocessing daemon may not):

    python -m tests_extend.unit.quant_states_worker ROOT   -> one JSON line on stdout

The torch trainer (Megatron-Core GPT, Megatron's optimizers, mock data) with --quant-states fp8 and
mxfp8 against fp32 moments for 20 updates (losses, weights, bytes held); --quant-grads against fp32
gradients (SGD over two micro-batches, Adam alone and with --quant-states under the distributed
optimizer; grad-buffer bytes); checkpoints saved mid-run in both formats and by the distributed optimizer, resumed."""
from __future__ import annotations

import json
import os
import sys

import torch

from mindspeed.features.training import quant_grads_megatron as qg
from mindspeed.features.training import quantized_moments as qm
from tests_extend.unit import swap_workers as kit

STEPS = 20
ONE_MICRO_BATCH = ["--global-batch-size", "2"]
# CI's time budget: mxfp8 under the distributed optimizer (its codec is the fp32 run's) where MINDSPEED_SLOW_TESTS=1
DISTRIBUTED_FORMATS = ("fp8", "mxfp8") if os.environ.get("MINDSPEED_SLOW_TESTS") else ("fp8",)


def optimizers(tr) -> list:
    return getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])


def weights(tr) -> list:
    return [p.detach().float().clone() for p in tr.model[0].parameters()]


def main_grads(tr) -> list:
    """The fp32 gradients the optimizer stepped with (its masters' or shards' .grad, kept until the next
    step zeroes them)."""
    return [p.grad.detach().clone() for o in optimizers(tr) for g in o.optimizer.param_groups for p in g["params"]]


def main_params(tr) -> list:
    return [p.detach().clone() for o in optimizers(tr) for g in o.optimizer.param_groups for p in g["params"]]


def grad_gap(grads: list, reference: list) -> float:
    """The largest gradient error relative to its tensor's largest reference element (per-tensor scales)."""
    return max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(grads, reference) if r.abs().max() > 0)


def run(flags: list, steps: int = STEPS) -> dict:
    args, tr = kit.trainer_for(ONE_MICRO_BATCH + flags)      # unless the flags say how many
    it = kit.batches(args, tr)
    losses, largest_grad, first_grads = [], 0.0, None
    for _ in range(steps):
        losses.append(tr.train_step(it)[0])
        first_grads = first_grads or main_grads(tr)
        largest_grad = max([largest_grad] + [float(p.grad.abs().max()) for o in optimizers(tr)
                                             for g in o.optimizer.param_groups for p in g["params"] if p.grad is not None])
    held, params = qg.grad_buffer_bytes(tr.model)
    out = {"losses": losses, "weights": weights(tr), "lr": args.lr, "grad_bytes_per_param": held / params,
           "largest_grad": largest_grad, "first_grads": first_grads, "masters": main_params(tr)}
    attached = [getattr(o, "mindspeed_quant_states", None) for o in optimizers(tr)]
    if all(attached):
        params = sum(p.numel() for s in attached for p in s.params())
        quantized = [p for s in attached for p in s.params() if s.quantized(p)]
        out.update(bytes_per_param=sum(s.state_bytes() for s in attached) / params,
                   quantized_fraction=sum(p.numel() for p in quantized) / params,
                   packed=sum(len(s.packed) for s in attached), quantized_params=len(quantized))
    return out


def max_gap(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# --quant-grads with Megatron's Float16Optimizer (bf16, SGD over two micro-batches): the first updates' gradients
# are what it adds; the 20-step SGD bound runs at DP 2 in test_optimizer_dp2.py (bf16 steps cost 5x fp32's here)
SGD_BF16 = (["--bf16", "--optimizer", "sgd", "--global-batch-size", "4"], ("--quant-grads",), 2)


def accuracy() -> dict:
    report = {}
    for base, formats, steps in (([], ("fp8", "mxfp8", "--quant-grads"), STEPS),
                                 (["--bf16", "--use-distributed-optimizer"], DISTRIBUTED_FORMATS + ("fp8 --quant-grads",), STEPS),
                                 (["--bf16", "--reuse-fp32-param"], ("fp8",), STEPS), SGD_BF16):
        reference = run(base, steps)
        reference_weights = reference.pop("weights")
        for fmt in formats:
            quant = run(base + _quant_flags(fmt), steps)
            quant["weight_gap"] = max_gap(quant.pop("weights"), reference_weights)
            quant["master_gap"] = max_gap(quant.pop("masters"), reference["masters"])
            quant["first_grad_gap"] = grad_gap(quant.pop("first_grads"), reference["first_grads"])
            quant.update({"reference_" + k: reference[k] for k in ("losses", "grad_bytes_per_param", "largest_grad")})
            report[" ".join(base + [fmt])] = quant
    return report


def _quant_flags(fmt: str) -> list:
    """"fp8" -> --quant-states fp8; "fp8 --quant-grads" -> both; "--quant-grads" -> the gradients alone."""
    words = fmt.split()
    return (["--quant-states", words[0]] if not words[0].startswith("--") else []) + \
        [w for w in words if w.startswith("--")]


def on_disk_moment_dtypes(path: str, iteration: int, fmt: str) -> list:
    directory = os.path.join(path, f"iter_{iteration:07d}")
    if fmt == "torch":
        from mindspeed.checkpoint import legacy
        (rank_dir,) = os.listdir(directory)
        saved = legacy.read_file(os.path.join(directory, rank_dir, "model_optim_rng.pt"))["optimizer"]
        inner = saved.get("optimizer", saved)
        return sorted({str(s[k].dtype) for s in inner["state"].values() for k in qm.MOMENT_DTYPES})
    from megatron.core.dist_checkpointing.serialization import load_tensors_metadata
    return sorted({str(meta.dtype) for key, meta in load_tensors_metadata(directory).items() if "exp_avg" in key})


def resumed(root: str, fmt: str, flags: list, half: int = 3) -> dict:
    """Train `half` updates, save in `fmt`, train `half` more; a new trainer with the same flags loads
    the checkpoint and trains `half` (both continuations), and one without --quant-states does too."""
    from mindspeed.checkpoint import legacy, torch_dist
    from mindspeed.training import pretrain
    path = os.path.join(root, fmt + "_" + "_".join(flags))
    all_flags = flags + ONE_MICRO_BATCH + ["--ckpt-format", fmt]
    args, tr = kit.trainer_for(all_flags)
    it = kit.batches(args, tr)
    for _ in range(half):
        tr.train_step(it)
    consumed = half * args.global_batch_size
    save = legacy.save_checkpoint if fmt == "torch" else torch_dist.save_checkpoint
    save(path, half, tr.model, tr.optimizer, tr.scheduler, consumed, **({"args": args} if fmt == "torch" else {}))
    continued = [tr.train_step(it)[0] for _ in range(half)]
    final = weights(tr)
    out = {"continued": continued, "on_disk": on_disk_moment_dtypes(path, half, fmt)}
    for name, load_flags in (("resumed", all_flags), ("resumed_without_flag", _without_quant(all_flags))):
        args2, tr2 = kit.trainer_for(load_flags + ["--load", path])
        pretrain.resume(args2, tr2, kit._Log())
        out[name] = kit.train(args2, tr2, half, consumed)
        if name == "resumed":
            out["final_weights_bitwise"] = all(torch.equal(a, b) for a, b in zip(weights(tr2), final))
    return out


def _without_quant(flags: list) -> list:
    i = flags.index("--quant-states")
    return flags[:i] + flags[i + 2:]


def main(root: str) -> dict:
    os.environ.pop("RANK", None)
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training import pretrain
    args = parse_args(kit.TINY, world_size=1)
    mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain.init_batch_schedule(args, 0)
    report = {"accuracy": accuracy(),
              "resume": {f"{fmt} {' '.join(flags)}": resumed(root, fmt, flags)
                         for fmt, flags in (("torch_dist", ["--quant-states", "fp8"]),
                                            ("torch", ["--quant-states", "mxfp8"]),
                                            ("torch_dist", ["--bf16", "--use-distributed-optimizer",
                                                            "--quant-states", "fp8"]))}}
    mindspeed.unadapt()
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
