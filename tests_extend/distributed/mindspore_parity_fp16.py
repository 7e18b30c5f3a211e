"""The --fp16 and --bf16 parity experiments (test_mindspore_parity_fp16.py, test_mindspore_parity_bf16.py
and their msrun worker): mindspore_parity's GPT, batches and optimizer settings in fp16 with fp32
masters and dynamic loss scaling, or in bf16 with fp32 masters and no scaling, trained by
Megatron-Core on torch (Float16Module, Float16OptimizerWithFloat16Params over torch.optim.AdamW, its
DynamicGradScaler under fp16) and by the MindSpore trainer. The initial weights are representable in
the 16-bit type, so the fp32 masters both sides build (torch from its 16-bit weights, MindSpore from
the loaded fp32 values) start equal."""
from __future__ import annotations

import numpy as np

from tests_extend.distributed import mindspore_parity as mp

# no overflow expected: the scale doubles after 10 clean steps (steps 10 and 20)
PARITY = ("--fp16", "--initial-loss-scale", str(2.0 ** 14), "--loss-scale-window", "10")
# forced overflows: 2**24 x gradients beyond fp16's 65504 until the scale has come down
OVERFLOW = ("--fp16", "--initial-loss-scale", str(2.0 ** 24))
OVERFLOW_STEPS = 9     # 7 skipped (torch's sequence), then 2 updates
BF16 = ("--bf16",)
# the bf16 parity bounds, in units of torch's own bf16 effect measured in the same run
# (test_mindspore_parity_bf16.py): MindSpore rounds at a subset of torch's rounding points, so each side
# is within that effect of fp32, and the two within twice it of each other (the triangle inequality)
GAP_FACTOR = 2.0


def bf16_effect(bf16: dict, fp32: dict, key: str = "losses", relative: bool = False) -> float:
    """How far bf16 (or fp16: any lower precision) moves a run: the largest gap between its values of
    `key` and the fp32 run's over the lower-precision run's steps (relative to the fp32 values if asked)."""
    b = np.array(bf16[key], np.float64)
    f = np.array(fp32[key][:len(b)], np.float64)
    return float((np.abs(b - f) / (np.abs(f) if relative else 1.0)).max())


def to_bf16(a: np.ndarray) -> np.ndarray:
    """fp32 values rounded to the nearest bf16 (ties to even), as fp32."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def checkpoint_of_masters(saved: str, masters: dict):
    """The neutral checkpoint saved at `saved` as (params, moments, meta), its parameters checked to be
    the run's fp32 master weights, exactly."""
    from mindspeed.checkpoint import neutral as nf
    params, moments, meta = nf.load(nf.resolve(saved, None))
    for name, value in params.items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, np.array(masters[name], np.float32), err_msg=name)
    return params, moments, meta


def write_init(path: str, dtype: str = "fp16") -> None:
    """The trainer's own initialisation (numpy, TP-independent), rounded to fp16 or bf16."""
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.checkpoint import neutral as nf
    from mindspeed.training.mindspore.model import GPTConfig, init_full_weights
    args = parse_args(mp.trainer_argv(1), world_size=1)
    full = init_full_weights(GPTConfig.from_args(args, mp.VOCAB), args.seed)
    rounded = to_bf16 if dtype == "bf16" else (lambda v: v.astype(np.float16).astype(np.float32))
    nf.save(path, 0, {k: rounded(v) for k, v in full.items()}, meta={"backend": "numpy"})


def _scaler_settings(flags) -> dict:
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore.mixed_precision import scaler_from_args
    s = scaler_from_args(parse_args(mp.trainer_argv(1) + list(flags), world_size=1))
    return dict(initial_scale=s.scale, min_scale=s.min_scale, growth_factor=2.0, backoff_factor=0.5,
                growth_interval=s.window, hysteresis=s.hysteresis)


# -- mindspore side ------------------------------------------------------------------------------
def ms_train_fp16(backend, init_ckpt: str, flags=PARITY, steps: int = mp.STEPS, *, tp: int = 1, sp: bool = False,
                  pp: int = 1, cp: int = 1, cp_algo: str = "megatron_cp_algo", distributed_optimizer: bool = False,
                  save_dir: str | None = None) -> dict:
    """Through the support matrix (mindspeed.adapt) as the trainer goes; every DP rank trains on the
    same batch (so DP=2 is DP=1's run; CP ranks hold shards of it). Per step: loss, grad norm (None
    when skipped), the loss scale after the step, whether it was skipped, the lr."""
    import mindspore as ms

    import mindspeed
    from mindspeed.backends import get_backend
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore import checkpoint
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    world = backend.comm.world_size()
    argv = mp.trainer_argv(tp, sp) + ["--global-batch-size", str(mp.MBS * world // (tp * pp * cp)),
                                      "--pipeline-model-parallel-size", str(pp)] + list(flags)
    argv += ["--context-parallel-size", str(cp), "--context-parallel-algo", cp_algo] if cp > 1 else []
    argv += ["--use-distributed-optimizer"] if distributed_optimizer else []
    args = parse_args(argv + (["--untie-embeddings-and-output-weights"] if pp > 1 else []), world_size=world)
    args.backend = "mindspore"
    session = mindspeed.adapt(args)       # as the trainer's setup does
    try:
        backend = get_backend()
        ps = build_parallel_state(backend.comm, tp, sp, cp, pp)
        trainer = Trainer(args, backend, ps, GPTConfig.from_args(args, mp.VOCAB, session.feature_ids), session)
        checkpoint.load(init_ckpt, trainer.model)
        out = {k: [] for k in ("losses", "grad_norms", "scales", "skipped", "lrs")}
        for step in range(steps):
            tokens, labels, mask = mp.batch(step)
            loss, norm, lr = trainer.train_step([{"tokens": tokens, "labels": labels, "loss_mask": mask}], step + 1)
            for key, value in zip(out, (loss, norm, trainer.loss_scale, trainer.last_step_skipped, lr)):
                out[key].append(value)
        tokens, labels, mask = mp.batch(mp.EVAL_SEED)
        out["eval_loss"] = trainer.evaluate([{"tokens": tokens, "labels": labels, "loss_mask": mask}])
        out["graph_mode"] = trainer.graph_mode
        out["param_dtypes"] = sorted({str(p.dtype) for p in trainer.model.params.values()})
        if save_dir:
            meta = {"backend": "mindspore", "skipped_iterations": trainer.skipped_iterations,
                    **({"grad_scaler": trainer.scaler.state_dict()} if trainer.scaler else {})}
            checkpoint.save(backend, ps, save_dir, steps, trainer.model, trainer.optimizer, meta)
            out["masters"] = {n: p.asnumpy().tolist() for n, p in trainer.model.master_params().items()}
            out["weights"] = {n: p.astype(ms.float32).asnumpy().tolist() for n, p in trainer.model.params.items()}
        # everything the model keeps between steps: weights, fp32 masters, --reuse-fp32-param's residuals
        kept = [*trainer.model.params.values(), *trainer.model.masters.values(),
                *(trainer.model.folded.residuals.values() if trainer.model.folded is not None else ())]
        out["kept_dtypes"] = sorted({str(t.dtype) for t in kept})
        return out
    finally:
        mindspeed.unadapt()


# -- torch side (Megatron-Core, in the gloo harness) ---------------------------------------------
def _torch_fp16_run(init_ckpt: str, flags, steps: int) -> dict:
    """Megatron-Core's fp16 (flags: the loss scaling) or, with BF16, bf16 (no grad scaler) run."""
    import torch
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.core.transformer.module import Float16Module
    bf16 = "--bf16" in flags
    model = mp.build_torch_model(1)
    mp.load_into_torch(model, init_ckpt, 0, 1)
    model.config.fp16, model.config.bf16 = not bf16, bf16
    wrapped = Float16Module(model.config, model)           # 16-bit weights; fp32 output (the loss)
    params = [p for _, p in wrapped.named_parameters()]
    inner = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": mp.OPT["weight_decay"]},
                               {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                              lr=mp.OPT["lr"], betas=mp.OPT["betas"], eps=mp.OPT["eps"])
    config = OptimizerConfig(fp16=not bf16, bf16=bf16, lr=mp.OPT["lr"], clip_grad=mp.OPT["clip"])
    scaler = None if bf16 else DynamicGradScaler(**_scaler_settings(flags))
    opt = Float16OptimizerWithFloat16Params(inner, config, scaler, None)
    out = {k: [] for k in ("losses", "grad_norms", "scales", "skipped", "lrs")}
    updates = 0
    for step in range(steps):
        lr = mp.lr_at(updates)          # Megatron's scheduler advances on successful steps only
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        loss = mp._torch_loss(wrapped, step)
        (loss * opt.get_loss_scale()).backward()           # what Megatron's schedule's grad_scale_func does
        ok, norm, _ = opt.step()
        updates += int(ok)
        for key, value in zip(out, (loss.item(), norm if ok else None, float(opt.get_loss_scale()), not ok, lr)):
            out[key].append(value)
    return out


def torch_runs(rank, world_size, init_ckpt, ms_ckpt):
    """Harness body (TP=1): fp16 with PARITY and OVERFLOW scaling, the fp32 reference, and the
    MindSpore fp16 run's checkpoint loaded into an fp32 Megatron-Core model and evaluated (the fp32
    run first: it adapts and initialises the process group)."""
    fp32 = mp.torch_train(rank, world_size, 1, init_ckpt, False, other_ckpt=ms_ckpt, steps=mp.STEPS)
    return {"fp16": _torch_fp16_run(init_ckpt, PARITY, mp.STEPS),
            "overflow": _torch_fp16_run(init_ckpt, OVERFLOW, OVERFLOW_STEPS), "fp32": fp32}


def torch_bf16_runs(rank, world_size, init_ckpt, ms_ckpt):
    """Harness body (TP=1): bf16, the fp32 reference from the same bf16-representable weights, and the
    MindSpore bf16 run's checkpoint loaded into an fp32 Megatron-Core model and evaluated."""
    fp32 = mp.torch_train(rank, world_size, 1, init_ckpt, False, other_ckpt=ms_ckpt, steps=mp.STEPS)
    return {"bf16": _torch_fp16_run(init_ckpt, BF16, mp.STEPS), "fp32": fp32}
