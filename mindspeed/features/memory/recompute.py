"""Selective recompute of cheap ops whose outputs the next op saves for backward (MindSpeed's
--recompute-activation-function and --recompute-norm). Framework-free: the Megatron-Core hook is
memory/megatron_recompute.py; the MindSpore trainer reads the flags itself (GPTConfig).

The work is the backend's `memory.recompute_output`: the op runs without a graph, its output is
freed once the consumer (fc2, or the attention/MLP after a norm) has run, and is rebuilt from the
kept input when the consumer's output gradient arrives. `--...-num-layers N` limits it to the
first N transformer layers of each model chunk (all layers when not given).
"""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag, switch
from mindspeed.features.registry import register


class _OutputRecompute(Feature):
    category = "memory"
    optimization_level = 2
    requires = (Cap.RECOMPUTE_OUTPUT,)
    backends = ("torch", "mindspore")
    # Megatron's selective recompute module that already covers this feature's op
    megatron_module = ""

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":       # mindspore: the trainer reads the flags (GPTConfig)
            from mindspeed.features.memory import megatron_recompute  # hook may import Megatron (.importlinter)
            megatron_recompute.install(ctx.patcher, args, ctx.backend.memory)

    @property
    def example(self) -> tuple:
        return (self.flags[0].name,)

    @property
    def num_layers_flag(self) -> Flag:
        return self.flags[1]

    def layers(self, args):
        """How many layers of each model chunk recompute (None: all)."""
        return getattr(args, self.num_layers_flag.dest)      # the subclass's own flag

    def validate(self, args) -> None:
        n, total, name = self.layers(args), args.num_layers, self.num_layers_flag.name
        if n is not None and n < 1:
            raise FeatureConfigError(f"{name} must be >= 1, got {n}")
        if n is not None and total is not None and n > total:
            raise FeatureConfigError(f"{name} {n} is more than --num-layers {total}")
        if args.recompute_granularity == "full":
            raise FeatureConfigError(f"{self.flags[0].name} with --recompute-granularity full: full recompute "
                                     "already keeps no activation inside a layer; use one of them")
        if args.recompute_granularity == "selective" and self.megatron_module in (args.recompute_modules or ()):
            raise FeatureConfigError(f"{self.flags[0].name} with --recompute-modules {self.megatron_module}: "
                                     "both recompute the same op; use one of them")


@register
class RecomputeActivationFunction(_OutputRecompute):
    id = "recompute-activation-function"
    description = ("MLP keeps only the activation's input; the SwiGLU/GELU output is freed after fc2 "
                   "and recomputed in backward")
    flags = (switch("--recompute-activation-function", "recompute the MLP activation (SwiGLU/GELU) in backward"),
             Flag("--recompute-activation-function-num-layers",
                  dict(type=int, default=None, help="only the first N layers of each model chunk (default: all)")))
    megatron_module = "mlp"
    alternatives = "leave it off, or --recompute-granularity full"


@register
class RecomputeNorm(_OutputRecompute):
    id = "recompute-norm"
    description = "RMSNorm/LayerNorm outputs freed after the attention/MLP that reads them, recomputed in backward"
    flags = (switch("--recompute-norm", "recompute the layers' RMSNorm/LayerNorm outputs in backward"),
             Flag("--recompute-norm-num-layers",
                  dict(type=int, default=None, help="only the first N layers of each model chunk (default: all)")))
    megatron_module = "layernorm"
    alternatives = "leave it off, or --recompute-granularity full"
