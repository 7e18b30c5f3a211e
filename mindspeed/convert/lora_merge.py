"""mg->hf with --lora-load: a LoRA run's adapters folded into the base model's linears on the way
out (weight + alpha/r * B @ A), as MindSpeed-LLM's converter merges them. The adapter checkpoint
records r, alpha and the target modules; the command line's --lora-r / --lora-alpha /
--lora-target-modules, where given, must agree with it."""
from __future__ import annotations

import torch

from mindspeed.checkpoint.megatron_read import STACKED, open_checkpoint
from mindspeed.errors import CheckpointError, ConvertError

# --lora-target-modules word -> the decoder layer's weight it adapts (model-local suffix)
TARGET_WEIGHTS = {"linear_qkv": "self_attention.linear_qkv.weight",
                  "linear_proj": "self_attention.linear_proj.weight",
                  "linear_fc1": "mlp.linear_fc1.weight",
                  "linear_fc2": "mlp.linear_fc2.weight"}


def recorded(lora_dir: str) -> dict:
    from mindspeed.checkpoint import torch_dist  # imports Megatron-Core, as open_checkpoint does
    try:
        saved = torch_dist.read_common(lora_dir).get("lora")
    except CheckpointError as err:
        raise ConvertError(f"--lora-load: {err}") from None
    if saved is None:
        raise ConvertError(f"--lora-load {lora_dir} holds no LoRA adapters (not the --save of a run with "
                           "--lora-target-modules)")
    return saved


def check_flags(opts, saved: dict) -> None:
    given = {"--lora-r": (opts.lora_r, saved["r"]), "--lora-alpha": (opts.lora_alpha, saved["alpha"]),
             "--lora-target-modules": (sorted(set(opts.lora_target_modules)) if opts.lora_target_modules else None,
                                       saved["target_modules"])}
    for flag, (value, recorded) in given.items():
        if value is not None and value != recorded:
            shown = " ".join(recorded) if isinstance(recorded, list) else f"{recorded:g}"
            raise ConvertError(f"{flag} does not match the adapters in {opts.lora_load}, which have {shown}")


class AdapterMerge:
    def __init__(self, opts):
        saved = recorded(opts.lora_load)
        check_flags(opts, saved)
        self.scale = saved["alpha"] / saved["r"]
        self.weights = [TARGET_WEIGHTS[t] for t in saved["target_modules"]]
        self.reader = open_checkpoint(opts.lora_load)

    def fold(self, mg: dict, layer: int) -> None:
        """Add each adapted weight's B @ A (scaled) to layer `layer`'s tensors in `mg`, in place."""
        for suffix in self.weights:
            stem = STACKED + suffix[:-len("weight")] + "lora."
            a = self.reader.layer_tensor(stem + "A", layer).float()
            b = self.reader.layer_tensor(stem + "B", layer).float()
            base = mg[suffix]
            mg[suffix] = (base.float() + self.scale * (b @ a)).to(base.dtype)


def adapters_for(opts) -> AdapterMerge | None:
    return AdapterMerge(opts) if opts.lora_load else None
