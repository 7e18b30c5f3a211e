"""--optimizer-selection fused_ema_adamw (upstream MindSpeed's name): AdamW plus an exponential moving
average (EMA) of the weights, updated inside the same optimizer step. `--ema-decay d` (default 0.9999,
upstream's) with upstream's warm-up: update t uses min(d, (1 + t) / (10 + t)). The EMA is optimizer
state ('ema_params', fp32 like the master weights), so both checkpoint formats save and load it;
--use-ema evaluates with the EMA weights.

Framework-free (the matrix imports it); the Megatron-Core hook is ema_adamw_megatron.py.
"""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag, switch
from mindspeed.features.host_flags import host
from mindspeed.features.registry import register

SELECTION = "fused_ema_adamw"
DEFAULT_DECAY = 0.9999


@register
class FusedEmaAdamW(Feature):
    id = "fused-ema-adamw"
    category = "training"
    description = ("AdamW and an exponential moving average of the weights in one optimizer step; the EMA "
                   "is saved in the checkpoint and --use-ema evaluates with it")
    flags = (Flag("--optimizer-selection", dict(type=str, default=None, choices=[SELECTION], help=(
                 "fused_ema_adamw: Megatron's AdamW plus an EMA of the weights (optimizer state "
                 "'ema_params', saved in checkpoints)"))),
             Flag("--ema-decay", dict(type=float, default=DEFAULT_DECAY, help=(
                 "EMA decay d; update t uses min(d, (1 + t) / (10 + t)) (upstream's warm-up)"))),
             switch("--use-ema", "validation and evaluation run with the EMA weights (needs "
                                 "--optimizer-selection fused_ema_adamw)"),
             host("--optimizer", "adam"), host("--use-distributed-optimizer", False))
    # --ckpt-format is read too: its default is megatron_defaults.HOST_FLAG_DEFAULTS' (defined once)
    requires = (Cap.MEGATRON_CORE,)
    backends = ("torch",)
    # upstream refuses it too: the bf16 parameters would be the masters' high halves, the EMA a third copy
    conflicts = ("reuse-fp32-param", "swap-optimizer")
    # not a MindSpore gap: the trainer's Adam (optimizer.py) is not wired for it yet
    unsupported = {"mindspore": "the MindSpore trainer's Adam (its fused AdamWeightDecay graph) keeps no EMA of the "
                                "weights yet and its checkpoints have no slot for one: use --backend torch"}
    alternatives = "drop --optimizer-selection: Megatron's AdamW runs without the EMA"
    example = ("--optimizer-selection", SELECTION)

    def enabled(self, args) -> bool:
        return args.optimizer_selection == SELECTION

    def on_hint(self) -> str:
        return f"--optimizer-selection {SELECTION}"

    def validate(self, args) -> None:
        if not 0.0 <= args.ema_decay < 1.0:
            raise FeatureConfigError(f"--ema-decay must be in [0, 1), got {args.ema_decay}")
        if args.optimizer != "adam":
            raise FeatureConfigError(f"--optimizer-selection {SELECTION} is AdamW: drop --optimizer "
                                     f"{args.optimizer}")
        if args.use_distributed_optimizer and args.ckpt_format == "torch":
            raise FeatureConfigError(f"--optimizer-selection {SELECTION} with --use-distributed-optimizer and "
                                     "--ckpt-format torch: the legacy format's distrib_optim.pt holds only "
                                     "param/exp_avg/exp_avg_sq, not the EMA shards; use --ckpt-format torch_dist")

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            from mindspeed.features.training import ema_adamw_megatron   # imports torch: applied only
            attached = ema_adamw_megatron.install(ctx.patcher, args.ema_decay)
            if not args.use_ema:
                return
            ctx.provide("ema_weights", ema_adamw_megatron.ema_weights)   # the built-in trainer's validation
            ema_adamw_megatron.evaluate_with_ema(ctx.patcher, attached)  # Megatron-LM's own loop's
