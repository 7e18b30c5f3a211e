"""What a run applied reaches its users as the Session, by parameter (docs/architecture.md, "The
session"): MindSpeed's modules hold no other process-wide state that a `global` statement rebinds,
and no feature plants state in a module through the patch manager (the hidden routes the session
replaced: a module's own `_state` swapped by a feature's hook). Nor does a feature ask the backend
registry for the active backend: the run's reaches it as ctx.backend and is handed to what it installs."""
import ast
import os

from tests_extend.unit.source_trees import package_trees

# the only module-level state a `global` statement rebinds, each with why it is process-wide
ALLOWED_GLOBALS = {
    "backends/__init__.py": "the active backend: what get_backend() answers, chosen by adapt (features get "
                            "it through the session's ApplyContext, never from here: see below)",
    "features/registry.py": "the feature modules are imported once, on the registry's first query",
    "data/workers.py": "one preprocessing worker process's function (multiprocessing's initializer)",
}


# what a feature module may not use from the backend registry (mindspeed/backends/__init__.py)
REGISTRY_GLOBALS = {"get_backend", "active_backend", "_active"}


def _registry_reads(tree) -> list[str]:
    """Where a module imports, calls or reads the registry's active backend: `from mindspeed.backends
    import get_backend`, `get_backend()`, `backends.get_backend()`, `backends._active`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "mindspeed.backends":
            found += [f"{node.lineno} import {a.name}" for a in node.names if a.name in REGISTRY_GLOBALS]
        elif isinstance(node, ast.Attribute) and node.attr in REGISTRY_GLOBALS:
            found.append(f"{node.lineno} .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in REGISTRY_GLOBALS:
            found.append(f"{node.lineno} {node.id}")
    return found


def _patcher_targets_of_own_module(tree) -> list[int]:
    """Lines where a patcher call names `f"{__name__}..."` or `f"{module.__name__}..."`: a MindSpeed
    module's own attribute swapped in."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and isinstance(node.args[0], ast.JoinedStr):
            parts = node.args[0].values
            named = parts[0].value if parts and isinstance(parts[0], ast.FormattedValue) else None
            if isinstance(named, ast.Name) and named.id == "__name__" or \
                    isinstance(named, ast.Attribute) and named.attr == "__name__":    # f"{module.__name__}._state"
                lines.append(node.lineno)
    return lines


def test_module_level_state_is_only_the_listed_registries():
    rebinding = {path for path, tree in package_trees() if any(isinstance(n, ast.Global) for n in ast.walk(tree))}
    assert rebinding == set(ALLOWED_GLOBALS), rebinding ^ set(ALLOWED_GLOBALS)


def test_no_feature_swaps_its_own_modules_state_through_the_patcher():
    found = {path: lines for path, tree in package_trees() for lines in [_patcher_targets_of_own_module(tree)] if lines}
    assert found == {}


def test_no_feature_reads_the_active_backend_from_the_registry():
    """Features take the backend their ApplyContext carries (ctx.backend) and pass it on; a hook that
    asked the registry would act on whatever backend is active when it runs, not the run's."""
    found = {path: lines for path, tree in package_trees() if path.startswith("features" + os.sep)
             for lines in [_registry_reads(tree)] if lines}
    assert found == {}
