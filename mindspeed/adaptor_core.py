"""Planning and applying MindSpeed: flags -> backend + device -> enabled features -> gate ->
device shim + feature hooks. Shared by `import mindspeed.megatron_adaptor`, `mindspeed.adapt()`
and `python -m mindspeed check`."""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Callable

from mindspeed import compile_cache, vec_isa_memo
from mindspeed.backends import active_backend, reset_backend, set_backend
from mindspeed.backends.mindspore.device_select import select_device as ms_select
from mindspeed.backends.mindspore.msadapter import msadapter_active
from mindspeed.backends.torch.device_select import device_without_torch
from mindspeed.backends.torch.triton_cpu import interpret_triton_on_cpu
from mindspeed.flags.mindspeed_flags import defaults, parse_mindspeed_args, resolve_backend_name
from mindspeed.features.base import ApplyContext, Feature, FeatureConfigError
from mindspeed.features.registry import all_features, enabled_features, orphan_flag_problems
from mindspeed.patching import GLOBAL_PATCHES, PatchManager
from mindspeed.session import Plan, Session
from mindspeed.support_matrix import UnsupportedFeatureError, check

log = logging.getLogger("mindspeed")
_DEVICE_ALIASES = {"torch": {"ascend": "npu"}, "mindspore": {"npu": "ascend"}}


class MindSpeedConfigError(RuntimeError):
    """Anything that makes a requested run impossible, found before work starts."""


def _as_namespace(args, unknown: str) -> argparse.Namespace:
    """Accept an argv list, a Namespace (e.g. Megatron's args), or None (defaults)."""
    if args is None:
        return defaults()
    if isinstance(args, (list, tuple)):
        return parse_mindspeed_args(list(args), unknown=unknown)
    merged = defaults()
    merged.backend = None
    for key, value in vars(args).items():
        setattr(merged, key, value)
    merged.backend = resolve_backend_name(merged)
    return merged


def _msadapter_active() -> bool:
    return msadapter_active()


def _user_chose_backend(args) -> bool:
    if isinstance(args, (list, tuple)):
        return any(a.split("=")[0] in ("--backend", "--ai-framework") for a in args)
    return args is not None and bool(getattr(args, "backend", None) or getattr(args, "ai_framework", None))


def resolve_device(backend: str, requested: str) -> str:
    requested = _DEVICE_ALIASES[backend].get(requested, requested)
    if backend == "torch":
        known = device_without_torch(requested)       # a CPU-only torch: no import needed to know
        if known is not None:
            return known
        from mindspeed.backends.torch.device import select_device  # imports torch: adaptor_core stays framework-free
        return select_device(requested)
    return ms_select(requested)


def _as_typed(f: Feature, ns) -> str:
    """An inert feature's flags as the user typed them: the first, then '(with ...)' the others."""
    typed = f.typed_flags(ns) or [f.trigger(ns)]
    return typed[0] + (f" (with {', '.join(typed[1:])})" if typed[1:] else "")


def plan(args=None, unknown_flags: str = "error") -> Plan:
    """args: an argv list (a whole command line: unknown flags are refused, or only likely typos
    with unknown_flags="typos"; "trainer": Megatron flags not given take the built-in trainers'
    defaults), a parsed Namespace, or None."""
    msadapter = _msadapter_active()
    try:
        ns = _as_namespace(args, unknown_flags)
        if msadapter and not _user_chose_backend(args):
            ns.backend = "mindspore"   # `import torch` is MindSpore underneath: it must serve kernels/comm
        device = resolve_device(ns.backend, getattr(ns, "mindspeed_device", "auto") or "auto")
        on = enabled_features(ns)
        inert = [(f, why, _as_typed(f, ns)) for f in on for why in [f.inert(ns)] if why]
        orphans = orphan_flag_problems(ns, {f.id for f in on})     # an inert feature's sub-flags are its own
        on = [f for f in on if not any(f is g for g, *_ in inert)]
        for f, *_ in inert:      # the rest is planned (and the host run) as without the inert flags
            for dest, value in f.inert_host_flags.items():
                setattr(ns, dest, value)
        for f in on:
            f.validate(ns)
        if orphans:
            raise FeatureConfigError("; ".join(orphans))
    except (FeatureConfigError, ValueError, RuntimeError, ImportError) as exc:
        raise MindSpeedConfigError(f"MindSpeed: {exc}") from exc
    level = ns.optimization_level
    kept = [f for f in on if f.optimization_level <= level]
    dropped = [f for f in on if f.optimization_level > level]
    try:
        check(kept, ns.backend, device, ns)
    except UnsupportedFeatureError as exc:
        raise MindSpeedConfigError(str(exc)) from exc
    for f in dropped:    # after the gate: a refusal is one line on stderr, not a warning and the error
        log.warning("MindSpeed: %s is above --optimization-level %d and is not applied", f.id, level)
    return Plan(ns, ns.backend, device, kept, dropped, msadapter, inert)


def activate_backend(backend_name: str, device: str, patcher: PatchManager = GLOBAL_PATCHES,
                     megatron_lm: bool = False, specs_from_session: bool = False) -> ApplyContext:
    """Create the backend and apply its device shim (plus the Megatron-LM training shim when the
    user's script is Megatron-LM's own)."""
    try:
        backend = set_backend(backend_name, device)
    except ImportError as exc:
        raise MindSpeedConfigError(f"MindSpeed: backend '{backend_name}' is unavailable: {exc}") from exc
    try:
        if backend_name == "torch":
            compile_cache.remove_broken_kernels()   # before anything compiles: a killed compile's leftovers
            vec_isa_memo.install(patcher)           # the CPU's vector-ISA probe, once per machine
            interpret_triton_on_cpu(patcher, device)  # before the shim imports Megatron's kernels
            from mindspeed.backends.torch.megatron_shim import apply_device_shim  # imports torch (see resolve_device)
            apply_device_shim(patcher, device, megatron_lm=megatron_lm)
            from mindspeed.features.memory import shared_mask  # always on: one causal mask object; imports torch
            shared_mask.install(patcher)
    except Exception:
        patcher.remove_all()   # never leave a half-patched process behind
        raise
    return ApplyContext(backend_name, device, patcher, backend, specs_from_session=specs_from_session)


def apply_features(ctx: ApplyContext, p: Plan) -> None:
    """Each enabled feature's hook, in registry order."""
    ctx.features = tuple(f.id for f in p.features)
    try:
        for f in p.features:
            f.apply(ctx, p.args)
    except Exception:
        ctx.patcher.remove_all()
        raise


@dataclass
class AppliedFeatures:
    """What one plan's features added to the process (their patches, parts and subscriptions), so a
    later plan can replace them: Megatron-Core's tests run Megatron-LM's parse_args/validate_args
    once per test in one process."""
    args: dict               # the plan's flags as applied
    patches: list            # the patcher's records the features added, oldest first
    parts: dict              # the context's parts and subscribers before the features ran
    subscribers: dict

    def same_plan(self, p: Plan) -> bool:
        try:
            return bool(self.args == vars(p.args))
        except Exception:    # a value whose == does not answer a bool (an array): treat as changed
            return False

    def undo(self, ctx: ApplyContext) -> None:
        for record in reversed(self.patches):     # newest first, as remove_all
            ctx.patcher.remove(record.target)
        ctx.parts.clear()
        ctx.parts.update(self.parts)
        ctx.subscribers.clear()
        ctx.subscribers.update(self.subscribers)


def apply_features_again(ctx: ApplyContext, p: Plan, previous: AppliedFeatures | None,
                         then: Callable[[], None] | None = None) -> AppliedFeatures:
    """apply_features for a host that may plan again in one process: the plan `previous` applied is
    kept as it is (Megatron's initialize is idempotent for the same flags); another plan first undoes
    `previous`'s features, then applies its own. then: the host's own patches that go with them."""
    if previous is not None:
        if previous.same_plan(p):
            return previous
        previous.undo(ctx)
    before = ctx.patcher.applied()
    parts = {name: list(v) for name, v in ctx.parts.items()}
    subscribers = {event: list(v) for event, v in ctx.subscribers.items()}
    apply_features(ctx, p)
    if then is not None:
        then()
    added = [r for r in ctx.patcher.applied() if all(r is not b for b in before)]
    return AppliedFeatures(dict(vars(p.args)), added, parts, subscribers)


def apply_plan(p: Plan, patcher: PatchManager = GLOBAL_PATCHES, specs_from_session: bool = False) -> Session:
    """Create the backend, apply its device shim, then each feature's hook, in order. An adaptation
    already in the process (a backend is active) is undone first: patches are process-wide.
    specs_from_session: the caller builds Megatron-Core's layer spec from the session's parts
    (training/layer_spec.py) instead of features patching Megatron's spec providers."""
    if active_backend() is not None:
        unadapt(patcher)
    ctx = activate_backend(p.backend, p.device, patcher, specs_from_session=specs_from_session)
    apply_features(ctx, p)
    return Session(p, ctx, patcher)


def set_host_flags(p: Plan, args) -> None:
    """The Megatron flags the enabled features stand for (Feature.host_flags), set in the host's
    namespace (plan() works on a copy); nothing for an argv list or None."""
    if args is None or isinstance(args, (list, tuple)):
        return
    for f in p.features:
        for dest, value in f.host_values(p.args).items():
            setattr(args, dest, value)
    for f, *_ in p.inert:
        for dest, value in f.inert_host_flags.items():
            setattr(args, dest, value)


def unadapt(patcher: PatchManager = GLOBAL_PATCHES) -> None:
    """Remove every patch MindSpeed applied in the process and forget the backend."""
    patcher.remove_all()
    reset_backend()


def feature_ids() -> list[str]:
    return [f.id for f in all_features()]
