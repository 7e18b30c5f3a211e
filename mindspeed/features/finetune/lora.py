"""LoRA fine-tuning with MindSpeed-LLM's flags: --lora-target-modules turns it on, --lora-r and
--lora-alpha size the adapters, --lora-load resumes them. Framework-free (the matrix imports it);
the adapters and their Megatron-Core hooks are lora_megatron.py, the trainer reads them through the
"lora" part. Only the built-in torch trainer saves and loads adapter-only checkpoints."""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag, switch
from mindspeed.features.host_flags import NUM_EXPERTS, until_given
from mindspeed.features.registry import register

TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
MLP_TARGETS = ("linear_fc1", "linear_fc2")


def adapter_settings(args) -> dict:
    """What an adapter checkpoint records about its adapters (checked on --lora-load and by the
    converter's merge)."""
    return {"r": int(args.lora_r), "alpha": float(args.lora_alpha),
            "target_modules": sorted(set(args.lora_target_modules))}


@register
class Lora(Feature):
    id = "lora"
    category = "finetune"
    optimization_level = 0
    description = ("LoRA fine-tuning: low-rank adapters on the chosen linear layers train while the base "
                   "model stays frozen; checkpoints hold only the adapters")
    flags = (Flag("--lora-target-modules", dict(nargs="+", default=[], choices=TARGET_MODULES, metavar="MODULE",
                                                help="linear layers that get LoRA adapters (turns LoRA on): "
                                                     "any of linear_qkv linear_proj linear_fc1 linear_fc2")),
             Flag("--lora-r", dict(type=int, default=16, help="LoRA rank r of the adapters")),
             Flag("--lora-alpha", dict(type=float, default=32.0,
                                       help="LoRA alpha: the adapters' output is scaled by alpha / r")),
             Flag("--lora-load", dict(default=None, metavar="DIR",
                                      help="adapter checkpoint to resume from (--load holds the base model)")),
             switch("--lora-ckpt-filter", "save only the adapters (MindSpeed-LLM's flag; LoRA checkpoints "
                                          "here always hold only the adapters)"),
             switch("--lora-fusion", "CCLoRA: overlap the adapters' communication with the base layer's "
                                     "(refused: not implemented)"))
    requires = (Cap.MEGATRON_CORE,)
    backends = ("torch",)
    conflicts = ("ascend-coc",)     # both rewrite the tensor-parallel linears' forward
    unsupported = {"mindspore": "the MindSpore trainer's GPT has no adapter layers, and its neutral checkpoints "
                                "no adapter-only form; fine-tune with --backend torch"}
    alternatives = "fine-tune every parameter (leave out --lora-target-modules)"
    megatron_lm_refusal = ("LoRA runs on the built-in torch trainer (tests_extend/example/pretrain_gpt.py), "
                           "whose checkpoints hold only the adapters; Megatron-LM's own checkpointing would "
                           "save and load the whole model")
    example = ("--lora-target-modules", "linear_qkv", "linear_fc2", "--lora-r", "4")

    def enabled(self, args) -> bool:
        return bool(args.lora_target_modules)

    def validate(self, args) -> None:
        if args.lora_r < 1:
            raise FeatureConfigError(f"--lora-r must be >= 1, got {args.lora_r}")
        if not args.lora_alpha > 0:
            raise FeatureConfigError(f"--lora-alpha must be > 0, got {args.lora_alpha}")
        if args.lora_fusion:
            raise FeatureConfigError("--lora-fusion (CCLoRA, overlapping the adapters' communication with the "
                                     "base layer's) is not implemented here: drop it; the adapters give the "
                                     "same results unfused")
        mlp = [m for m in args.lora_target_modules if m in MLP_TARGETS]
        if until_given(args, NUM_EXPERTS) and mlp:
            raise FeatureConfigError(f"--lora-target-modules {' '.join(mlp)} with --num-experts: adapters on MoE "
                                     "experts are not implemented; target linear_qkv and linear_proj only")

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            from mindspeed.features.finetune import lora_megatron  # imports torch and Megatron: applied only
            ctx.provide("lora", lora_megatron.install(ctx.patcher, args))
