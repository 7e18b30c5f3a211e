"""All features, in the deterministic order they are applied.

Each feature module registers its classes with @register; FEATURE_MODULES lists the modules so
importing the registry loads them all (no scanning, no import-time side effects beyond that).
"""
from __future__ import annotations

import importlib

from mindspeed.features.base import Feature, FeatureConfigError

FEATURE_MODULES = [
    "mindspeed.features.parallel.megatron_parallel",
    "mindspeed.features.context_parallel.feature",
    "mindspeed.features.observability.profiling",
    "mindspeed.features.fused.features",
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


def enabled_features(args) -> list[Feature]:
    """The enabled features, checked for conflicts and dependencies; deterministic order."""
    on = [f for f in all_features() if f.enabled(args)]
    ids = {f.id for f in on}
    problems = []
    for f in on:
        for other in f.conflicts:
            if other in ids and f.id < other:   # report each pair once
                problems.append(f"feature '{f.id}' conflicts with '{other}': enable only one of them")
        for need in f.depends:
            if need not in ids:
                problems.append(f"feature '{f.id}' needs '{need}' to be enabled too")
    if problems:
        raise FeatureConfigError("; ".join(problems))
    return on
