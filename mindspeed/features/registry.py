"""All features, in the deterministic order they are applied.

Each feature module registers its classes with @register; FEATURE_MODULES lists the modules so
importing the registry loads them all (no scanning, no import-time side effects beyond that).
"""
from __future__ import annotations

import importlib

from mindspeed.features.base import Feature, FeatureConfigError

FEATURE_MODULES = [
    "mindspeed.features.parallel.megatron_parallel",
    "mindspeed.features.parallel.ascend_coc",
    "mindspeed.features.moe.features",
    "mindspeed.features.moe.zero_memory",
    "mindspeed.features.moe.fb_overlap_feature",
    "mindspeed.features.parallel.layers",
    "mindspeed.features.parallel.unaligned_pipeline",
    "mindspeed.features.parallel.fsdp2",
    "mindspeed.features.parallel.dualpipev",
    "mindspeed.features.parallel.tp2d",
    "mindspeed.features.context_parallel.feature",
    "mindspeed.features.observability.profiling",
    "mindspeed.features.observability.throughput",
    "mindspeed.features.training.deterministic",
    "mindspeed.features.training.quant_states",
    "mindspeed.features.training.quant_grads",
    "mindspeed.features.training.ema_adamw",
    "mindspeed.features.fused.features",
    "mindspeed.features.fused.alibi",
    "mindspeed.features.megatron_options",
    "mindspeed.features.model_family_options",
    "mindspeed.features.memory.recompute",
    "mindspeed.features.memory.adaptive_recompute",
    "mindspeed.features.memory.recompute_in_bubble",
    "mindspeed.features.memory.swap_features",
    "mindspeed.features.memory.reuse_fp32_param",
    "mindspeed.features.finetune.lora",
    "mindspeed.features.planned",
    "mindspeed.features.by_design",
]
_REGISTRY: dict[str, Feature] = {}
_loaded = False


def register(cls):
    inst = cls()
    if not inst.id or inst.id in _REGISTRY:
        raise ValueError(f"feature id {inst.id!r} is empty or registered twice")
    _REGISTRY[inst.id] = inst
    return cls


def all_features() -> list[Feature]:
    """Features sorted by (optimization level, category, id): a stable application order."""
    global _loaded
    if not _loaded:
        for name in FEATURE_MODULES:
            importlib.import_module(name)
        _loaded = True
    return sorted(_REGISTRY.values(), key=lambda f: (f.optimization_level, f.category, f.id))


def get_feature(feature_id: str) -> Feature:
    for f in all_features():
        if f.id == feature_id:
            return f
    raise KeyError(f"unknown feature {feature_id!r}")


def fast_kernels(feature_ids) -> frozenset:
    """The kernels (KernelsAPI names) these features switch to the device's fast path (Feature.kernels)."""
    return frozenset(k for feature_id in feature_ids for k in get_feature(feature_id).kernels)


def enabled_features(args) -> list[Feature]:
    """The enabled features, checked for conflicts and dependencies; deterministic order."""
    on = [f for f in all_features() if f.enabled(args)]
    ids = {f.id for f in on}
    problems, reported = [], set()
    for f in on:
        for other in f.conflicts:       # declared on either side: each pair reported once
            if other in ids and frozenset((f.id, other)) not in reported:
                reported.add(frozenset((f.id, other)))
                problems.append(f"feature '{f.id}' conflicts with '{other}': enable only one of them")
        for need in f.depends:
            if need not in ids:
                problems.append(f"{f.trigger(args)} ({f.id}) needs {_how_to_enable(need)} to be on too")
    if problems:
        raise FeatureConfigError("; ".join(problems))
    return on


def _how_to_enable(feature_id: str) -> str:
    try:
        return f"{get_feature(feature_id).on_hint()} ({feature_id})"
    except KeyError:
        return f"'{feature_id}'"


def orphan_flag_problems(args, enabled_ids: set) -> list[str]:
    """A MindSpeed sub-flag (e.g. --sparse-mode, --profile-ranks) changed from its default while
    no feature that reads it is on would be accepted and ignored: each is a problem."""
    owners: dict[str, list[Feature]] = {}
    for f in all_features():
        for fl in f.flags:
            owners.setdefault(fl.name, []).append(f)
    problems = []
    for name, features in owners.items():
        fl = next(x for x in features[0].flags if x.name == name)
        if fl.megatron or not hasattr(args, fl.dest) or getattr(args, fl.dest) == fl.default:
            continue
        if any(f.id in enabled_ids for f in features):
            continue
        if len(features) == 1 and fl is features[0].flags[0]:
            continue                    # a feature's own switch: if it changed, the feature is on
        if len(features) > 1:           # a flag several features read (CP's, by every algorithm)
            hint = features[0].shared_hint or features[0].on_hint()
            who = ", ".join(f.id for f in features)
        else:
            hint, who = features[0].on_hint(), features[0].id
        problems.append(f"{name} has no effect without {hint} ({who}): add it or drop {name}")
    return problems
