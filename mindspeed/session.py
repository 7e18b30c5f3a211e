"""What one run planned and applied, passed by parameter to whoever acts on it.

`adaptor_core.plan` makes a Plan (flags -> backend, device, enabled features); `apply_plan` applies it
and returns the Session. The trainers, `mindspeed.evaluate`/`generate`, the converter and Megatron-LM's
hooks receive the Session and ask it: which features are applied, how a batch is cut for context
parallelism, which attention and fused kernels are in effect, whether batches carry packed documents.
Nothing below the entry points reads it from a global.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from mindspeed.backends import reset_backend
from mindspeed.features.base import ApplyContext, Feature
from mindspeed.patching import PatchManager

# the attention a run without flash attention or context parallelism uses
CORE_ATTENTION = "megatron-core"


@dataclass
class Plan:
    args: argparse.Namespace
    backend: str
    device: str
    features: list[Feature]
    dropped: list[Feature] = field(default_factory=list)   # above --optimization-level
    msadapter: bool = False
    # (feature, why, its flags as typed) for each feature the flags turn on that has no effect in this
    # layout (Feature.inert); `args` holds its inert_host_flags' values instead of the typed ones
    inert: list = field(default_factory=list)

    def notes(self) -> list[str]:
        """One line per accepted feature that does nothing here, naming its flags, for the trainers'
        logs and `check`."""
        return [f"MindSpeed: {typed} has no effect here: {why}" for _, why, typed in self.inert]

    def describe(self) -> str:
        lines = [f"backend: {self.backend} (device {self.device})"
                 + (" via MSAdapter" if self.msadapter else ""),
                 f"optimization level: {self.args.optimization_level}",
                 "features: " + (", ".join(f.id for f in self.features if f.category != "option") or "(none)")]
        if self.dropped:
            lines.append("dropped by --optimization-level: " + ", ".join(f.id for f in self.dropped))
        return "\n".join(lines)


@dataclass
class Session:
    """A run's applied plan: its backend and the parts its features provide (`context`), and the
    patches that carry them (`patcher`; `close` undoes them)."""
    plan: Plan
    context: ApplyContext
    patcher: PatchManager

    @property
    def backend(self):
        return self.context.backend

    @property
    def device(self) -> str:
        return self.plan.device

    @property
    def feature_ids(self) -> tuple[str, ...]:
        return tuple(f.id for f in self.plan.features)

    def applied(self, feature_id: str) -> bool:
        return feature_id in self.feature_ids

    def part(self, name: str):
        """What an applied feature provides the trainer under `name` (ApplyContext.provide), or None."""
        return self.context.part(name)

    @property
    def shard_batch(self):
        """The context-parallel feature's batch sharding, batch -> this rank's batch; None without one
        (the host's own split, or none at CP 1)."""
        return self.part("shard_batch")

    @property
    def attention(self) -> str:
        """The attention in use: the context-parallel algorithm's feature id, `flash-attn`, or
        Megatron-Core's own."""
        for f in self.plan.features:
            if f.category == "context_parallel":
                return f.id
        return "flash-attn" if self.applied("flash-attn") else CORE_ATTENTION

    @property
    def fused_features(self) -> tuple[str, ...]:
        """The applied fused-kernel features (ids), in registry order."""
        return tuple(f.id for f in self.plan.features if f.category == "fused")

    @property
    def fast_kernels(self) -> frozenset:
        """The kernels (KernelsAPI names) the applied features run on the device's fast path."""
        return frozenset(k for f in self.plan.features for k in f.kernels)

    def packed_documents(self, args) -> bool:
        """Whether the kernel path takes packed documents (features/documents.py; no dense mask is
        built): --reset-attention-mask with flash attention or context parallelism as applied (one
        dropped by --optimization-level falls back to the mask), unless CP is asked for the batch's
        general mask. Documents are EOD-separated, or --neat-pack's numbered samples. A host whose
        batches cannot carry them everywhere (Megatron-LM's pretrain_gpt.py with PP > 1) says so
        through the `documents_possible` part; the dense mask stays there."""
        if not args.reset_attention_mask or args.attention_mask_type == "general":
            return False
        if not all(rule(args) for rule in self.context.parts.get("documents_possible", [])):
            return False
        return self.attention != CORE_ATTENTION

    def publish(self, event: str, **info) -> None:
        self.context.publish(event, **info)

    def notes(self) -> list[str]:
        return self.plan.notes()

    def close(self) -> None:
        """Undo every patch this session applied and forget its backend."""
        self.patcher.remove_all()
        reset_backend()
