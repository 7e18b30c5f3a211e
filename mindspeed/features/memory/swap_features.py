"""Memory savers that move state to host memory: --swap-attention and --swap-optimizer.
Framework-free (the matrix imports it); the work is in activation_swap.py and the Megatron-Core
hooks swap_attention_megatron.py / swap_optimizer_megatron.py (framework-free at import too: they
reach torch and Megatron through the backend and the patch manager, when applied)."""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag, switch
from mindspeed.features.memory import swap_attention_megatron, swap_optimizer_megatron
from mindspeed.features.memory.activation_swap import ActivationSwapper
from mindspeed.features.registry import register

# --swap-modules names: Megatron-Core TransformerLayer attributes, plus upstream MindSpeed's
# legacy names for the two norms
MODULE_ALIASES = {"input_norm": "input_layernorm", "post_attention_norm": "pre_mlp_layernorm"}
SWAPPABLE = ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp")


def swap_module_names(args) -> list[str]:
    words = [w.strip() for w in (args.swap_modules or "self_attention").split(",") if w.strip()]
    return [MODULE_ALIASES.get(w, w) for w in words]


@register
class SwapAttention(Feature):
    id = "swap-attention"
    category = "memory"
    description = ("activations the attention saves for backward held in host memory between forward and "
                   "backward, prefetched back layer by layer")
    flags = (switch("--swap-attention", "keep attention activations saved for backward in host memory"),
             Flag("--swap-modules", dict(type=str, default=None, help=(
                 "comma-separated TransformerLayer modules to swap (default self_attention; "
                 f"{', '.join(SWAPPABLE)}; upstream's input_norm, post_attention_norm)"))))
    requires = (Cap.HOST_OFFLOAD,)
    backends = ("torch", "mindspore")
    example = ("--swap-attention",)

    def validate(self, args) -> None:
        names = swap_module_names(args)
        bad = [n for n in names if n not in SWAPPABLE]
        if bad or not names:
            raise FeatureConfigError(f"--swap-modules {args.swap_modules!r}: unknown module "
                                     f"{', '.join(bad) or '(none given)'}; choose from {', '.join(SWAPPABLE)}, "
                                     f"{', '.join(MODULE_ALIASES)}")

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            swapper = swap_attention_megatron.install(ctx.patcher, swap_module_names(args), ctx.backend.memory)
            ctx.provide("activation_swapper", swapper)        # what it moved (tests, benchmarks)
        else:   # the MindSpore GPT asks for (scope, module names) when it is built
            swapper, names = ActivationSwapper(ctx.backend.memory), swap_module_names(args)
            ctx.provide("activation_swap", lambda: (swapper.scope, names))


@register
class SwapOptimizer(Feature):
    id = "swap-optimizer"
    category = "memory"
    description = ("optimizer states (fp32 master copy, Adam moments) held in host memory, swapped in by "
                   "chunks for the update")
    flags = (switch("--swap-optimizer", "keep optimizer states in host memory between updates"),
             Flag("--swap-optimizer-times", dict(type=int, default=16, help=(
                 "chunks the update swaps the states in by (more: less device memory at once)"))))
    requires = (Cap.HOST_OFFLOAD, Cap.MEGATRON_CORE)
    backends = ("torch",)
    # what would lift it: Parameter._offload() releasing a CPU parameter's memory (checked by
    # tests_extend/unit/test_mindspore_swap_optimizer_gap.py)
    unsupported = {"mindspore": "MindSpore 2.10 cannot release a Parameter's memory and bring it back on CPU "
                                "(Parameter._offload/_load are Ascend-only: on CPU the data stays where it is), "
                                "and its fused AdamWeightDecay updates the moments as whole Parameters in place, "
                                "so the MindSpore trainer has no chunked host-resident update: use the torch "
                                "backend"}
    example = ("--swap-optimizer",)

    def validate(self, args) -> None:
        times = args.swap_optimizer_times
        if times is None or times < 1:
            raise FeatureConfigError(f"--swap-optimizer-times must be >= 1, got {times}")

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            swap_optimizer_megatron.install(ctx.patcher, args, ctx.backend.memory)
