"""--lora-load for generation and evaluation: a LoRA run's adapters (its --save) on --load's base
model, applied on load and folded into the weights (weight + alpha/r * B @ A) as the converter's
mg->hf merge folds them. r, alpha and the target modules come from the adapter checkpoint's record;
--lora-r / --lora-alpha / --lora-target-modules (MindSpeed-LLM's inference command lines) may be
given and must agree with it."""
from __future__ import annotations

from mindspeed.convert import lora_merge
from mindspeed.errors import ConvertError, InferenceError, positive_int
from mindspeed.features.finetune.lora import TARGET_MODULES


def add_flags(parser) -> None:
    parser.add_argument("--lora-load", default=None, metavar="DIR",
                        help="a LoRA run's adapter checkpoint (its --save): merged into --load's base model on load")
    parser.add_argument("--lora-r", type=positive_int, default=None, help="with --lora-load: checked against the adapters")
    parser.add_argument("--lora-alpha", type=float, default=None,
                        help="with --lora-load: checked against the adapters")
    parser.add_argument("--lora-target-modules", nargs="+", default=None, choices=TARGET_MODULES, metavar="MODULE",
                        help="with --lora-load: checked against the adapters")


def settings(opts) -> dict:
    """The LoRA feature's trainer flags (as argument names) for the adapters of --lora-load, read
    from its checkpoint and checked before any process group; {} without --lora-load."""
    if not opts.lora_load:
        given = next((f for f in ("lora_r", "lora_alpha", "lora_target_modules") if getattr(opts, f) is not None),
                     None)
        if given:
            raise InferenceError(f"--{given.replace('_', '-')} describes LoRA adapters: give them with --lora-load")
        return {}
    try:
        saved = lora_merge.recorded(opts.lora_load)
        lora_merge.check_flags(opts, saved)
    except ConvertError as err:
        raise InferenceError(str(err)) from None
    return dict(lora_target_modules=list(saved["target_modules"]), lora_r=int(saved["r"]),
                lora_alpha=float(saved["alpha"]), lora_load=opts.lora_load)


def as_flags(lora: dict) -> list[str]:
    """`settings` as a command line for mindspeed.adapt."""
    if not lora:
        return []
    return ["--lora-target-modules", *lora["lora_target_modules"], "--lora-r", str(lora["lora_r"]),
            "--lora-alpha", repr(lora["lora_alpha"]), "--lora-load", lora["lora_load"]]
