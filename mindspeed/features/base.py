"""What a feature is: flags, requirements, validation, and thin per-backend integration hooks.

A feature's logic lives in its own module and talks to the backend interface only; `apply`
methods are the hooks that route a host model (Megatron-Core on the torch backend, MindSpeed's
MindSpore GPT on the mindspore backend) to that logic.
"""
from __future__ import annotations

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

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.name.lstrip("-").replace("-", "_")


def switch(name: str, help: str) -> Flag:
    return Flag(name, dict(action="store_true", default=False, help=help))


class Feature:
    """Subclass per feature. Class attributes describe it; methods act on parsed args."""

    id: str = ""                       # the same word as its flag, without --use-/--
    category: str = ""                 # fused | context_parallel | memory | moe | parallel | observability
    description: str = ""
    flags: tuple[Flag, ...] = ()
    requires: tuple[str, ...] = ()     # capability names (mindspeed.backends.base.Cap)
    conflicts: tuple[str, ...] = ()    # feature ids that cannot be on together with this one
    depends: tuple[str, ...] = ()      # feature ids that must be on too
    optimization_level: int = 2        # 0 basic compatibility, 1 affinity (fused), 2 acceleration
    backends: tuple[str, ...] = ("torch", "mindspore")  # backends that have an integration hook
    alternatives: str = ""             # shown when refused: what would work instead

    def enabled(self, args: Any) -> bool:
        """Default: the first flag is a switch that turns the feature on."""
        return bool(getattr(args, self.flags[0].dest, False)) if self.flags else False

    def validate(self, args: Any) -> None:
        """Raise FeatureConfigError for bad values. Runs before process groups exist."""

    def apply(self, ctx: "ApplyContext", args: Any) -> None:
        """Integrate with the host model of ctx.backend (patches go through ctx.patcher)."""

    def __repr__(self) -> str:
        return f"<Feature {self.id}>"


@dataclass
class ApplyContext:
    backend_name: str
    device: str
    patcher: Any                  # mindspeed.patching.PatchManager
    backend: Any = None           # the live backend object, when one is created
    hooks: dict = field(default_factory=dict)  # host-model hooks registered by features, by name

    def add_hook(self, name: str, fn: Callable) -> None:
        self.hooks.setdefault(name, []).append(fn)
