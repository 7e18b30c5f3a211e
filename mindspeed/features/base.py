"""What a feature is: flags, requirements, validation, and thin per-backend integration hooks.

A feature's logic lives in its own module and talks to the backend interface only; `apply`
methods are the hooks that route a host model (Megatron-Core on the torch backend, MindSpeed's
MindSpore GPT on the mindspore backend) to that logic.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable


class FeatureConfigError(ValueError):
    """Bad flag values or an impossible combination, reported before any work starts."""


@dataclass(frozen=True)
class Flag:
    """One command-line flag; kwargs go to argparse.add_argument."""
    name: str                     # "--use-fused-rmsnorm"
    kwargs: dict = field(default_factory=dict)
    megatron: bool = False        # Megatron's own flag (e.g. --context-parallel-size) that we key on
    host: bool = False            # defined only by the host's parser (the trainers', Megatron-LM's):
                                  # MindSpeed reads its value but never adds the option itself

    @property
    def default(self):
        if "default" in self.kwargs:
            return self.kwargs["default"]
        return False if self.kwargs.get("action") == "store_true" else None

    @functools.cached_property
    def dest(self) -> str:              # read for every flag on every check: computed once
        return self.kwargs.get("dest") or self.name.lstrip("-").replace("-", "_")


def switch(name: str, help: str) -> Flag:
    return Flag(name, dict(action="store_true", default=False, help=help))


def host_flag(name: str, dest: str | None = None) -> Flag:
    """A Megatron flag the host parser defines (defaults and choices are the host's)."""
    return Flag(name, dict(dest=dest) if dest else {}, megatron=True, host=True)


class Feature:
    """Subclass per feature. Class attributes describe it; methods act on parsed args."""

    id: str = ""                       # the same word as its flag, without --use-/--
    category: str = ""                 # fused | context_parallel | memory | moe | parallel | observability
    description: str = ""
    flags: tuple[Flag, ...] = ()
    requires: tuple[str, ...] = ()     # capability names (mindspeed.backends.base.Cap)
    kernels: tuple[str, ...] = ()      # the kernels (KernelsAPI names) it switches to the device's fast path
    conflicts: tuple[str, ...] = ()    # feature ids that cannot be on together with this one
    depends: tuple[str, ...] = ()      # feature ids that must be on too
    optimization_level: int = 2        # 0 basic compatibility, 1 affinity (fused), 2 acceleration
    backends: tuple[str, ...] = ("torch", "mindspore")  # backends that have an integration hook
    alternatives: str = ""             # shown when refused: what would work instead
    # cells a backend's trainer cannot run, with the reason: {"mindspore": "...", "torch/npu": "..."}
    unsupported: dict = {}
    # cells whose trainer runs it with the same result by a slower path, with how: {"mindspore": "..."}
    emulated: dict = {}
    megatron_lm_refusal: str = ""      # why Megatron-LM's own scripts cannot run it (empty: they can)
    planned: str = ""                  # not implemented yet: where it is tracked (refused everywhere)
    by_design: str = ""                # refused everywhere by design: why it cannot run in this project
    example: tuple[str, ...] = ()      # argv that turns the feature on (docs, the matrix walk test)
    example_world: int = 1             # processes that argv needs
    examples: dict = {}                # backend -> its own example, where it differs from `example`
    # Megatron flags (dest -> value) the feature stands for: adapt(namespace) and Megatron-LM's
    # validate_args hook set them in the host's own args, so its trainer acts on them
    host_flags: dict = {}
    before_host_checks = False         # host_values must be set before the host's own argument checks

    def enabled(self, args: Any) -> bool:
        """Default: the first flag is a switch that turns the feature on."""
        return bool(getattr(args, self.flags[0].dest)) if self.flags else False

    shared_hint = ""     # how to turn on any feature of its family (for flags the family shares)

    def on_hint(self) -> str:
        """How a user turns the feature on (for "X has no effect without ..." messages)."""
        return self.flags[0].name if self.flags else self.id

    def trigger(self, args: Any) -> str:
        """The flag (with its value) that turned the feature on, as the user typed it."""
        typed = self.typed_flags(args)
        return typed[0] if typed else (self.flags[0].name if self.flags else self.id)

    def typed_flags(self, args: Any) -> list[str]:
        """Each of the feature's flags changed from its default, as the user typed it (with its value)."""
        typed = []
        for fl in self.flags:
            # a host flag the host's own args may lack (an older Megatron-LM; --num-experts until given)
            value = getattr(args, fl.dest, fl.default)
            if value == fl.default or value is None:
                continue
            if isinstance(value, bool):
                typed.append(fl.name)
                continue
            shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            typed.append(f"{fl.name} {shown}")
        return typed

    def host_values(self, args: Any) -> dict:
        """The host flags to set, given the command line's values (default: host_flags)."""
        return dict(self.host_flags)

    def validate(self, args: Any) -> None:
        """Raise FeatureConfigError for bad values. Runs before process groups exist."""

    def inert(self, args: Any) -> str:
        """Why this enabled feature has no effect in the given layout ('' when it has one), as Megatron
        says of --sequence-parallel at TP 1: the plan then accepts it, applies nothing, and says so in
        one line. Only for what cannot act here; what cannot be honoured is a validate() refusal."""
        return ""

    # flag values (dest -> value) the plan's namespace and the host's take when the feature is inert,
    # so that neither the other features' checks nor the host act on the flag: Megatron-Core itself
    # refuses some values its parser lets through (sequence_parallel at TP 1)
    inert_host_flags: dict = {}
    inert_example: tuple = ()          # argv that turns the feature on where it has no effect (tests)

    def apply(self, ctx: "ApplyContext", args: Any) -> None:
        """Integrate with the host model of ctx.backend (patches go through ctx.patcher)."""

    def __repr__(self) -> str:
        return f"<Feature {self.id}>"


# Training-loop events a trainer publishes (ApplyContext.publish) and features subscribe to.
TRAIN_STEP_BEGIN = "train_step_begin"     # info: iteration (the one about to run)
TRAIN_STEP_END = "train_step_end"         # info: iteration (the one just run)
TRAIN_END = "train_end"                   # info: iteration (the last one run)


@dataclass
class ApplyContext:
    backend_name: str
    device: str
    patcher: Any                  # mindspeed.patching.PatchManager
    backend: Any = None           # the live backend object, when one is created
    parts: dict = field(default_factory=dict)        # name -> what features provide to the host trainer
    features: tuple = ()          # ids of the features the plan applies (set before their hooks run)
    # True: the host builds Megatron-Core's layer spec itself from the parts features provide (the
    # built-in trainers: training/layer_spec.py); False: features patch Megatron's spec providers
    # process-wide (Megatron-LM's scripts, a user's own spec)
    specs_from_session: bool = False
    subscribers: dict = field(default_factory=dict)  # training-loop event -> callbacks

    def applies(self, feature_id: str) -> bool:
        """Whether the plan being applied turns on `feature_id` (one feature's hook asking about another's)."""
        return feature_id in self.features

    def provide(self, name: str, part: Any) -> None:
        """Offer the trainer a named part (a batch sharder, an attention, ...); the last one wins."""
        self.parts.setdefault(name, []).append(part)

    def part(self, name: str) -> Any:
        """The last part provided under `name`, or None."""
        provided = self.parts.get(name)
        return provided[-1] if provided else None

    def subscribe(self, event: str, fn: Callable) -> None:
        """Call fn(**info) when the trainer publishes `event` (TRAIN_STEP_BEGIN, ...)."""
        self.subscribers.setdefault(event, []).append(fn)

    def publish(self, event: str, **info) -> None:
        for fn in self.subscribers.get(event, []):
            fn(**info)
