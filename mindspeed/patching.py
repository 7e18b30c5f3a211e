"""One patch manager for every change MindSpeed makes to Megatron-Core, torch or MindSpore.

Rules (docs/architecture.md): a patch is an explicit `replace` or `wrap`; a target that does not
exist is an error, never a silent no-op; every applied patch is listed; all can be removed.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

_MISSING = object()


class PatchError(RuntimeError):
    """A patch target cannot be resolved, or a patch is applied twice."""


@dataclass
class AppliedPatch:
    target: str            # dotted path as the caller wrote it
    kind: str              # "replace", "wrap", "define", "module", "env", "context" or "import"
    owner: Any             # module or class that holds the attribute
    attr: str
    original: Any          # the raw attribute (descriptor kept for class attributes)
    new: Any
    reason: str = ""
    aliases: list = field(default_factory=list)  # (owner, attr, original) also rebound
    inherited: bool = False  # class attribute that lived on a base class before patching

    def describe(self) -> str:
        extra = f" (+{len(self.aliases)} alias{'es' if len(self.aliases) != 1 else ''})" if self.aliases else ""
        why = f" - {self.reason}" if self.reason else ""
        return f"{self.kind:7s} {self.target}{extra}{why}"


def _is_missing(err: ImportError, name: str) -> bool:
    """True when `err` says the module `name` (or a package above it) does not exist, not that
    something it imports is missing."""
    missing = getattr(err, "name", None)
    return isinstance(err, ModuleNotFoundError) and missing is not None and (
        name == missing or name.startswith(missing + "."))


def resolve(target: str) -> tuple[Any, str]:
    """Split 'pkg.mod.Class.attr' into (owner object, 'attr'); raise PatchError if absent."""
    parts = target.split(".")
    if len(parts) < 2:
        raise PatchError(f"patch target {target!r} must be a dotted path 'module.attr'")
    owner, index = None, 0
    # import the longest importable module prefix
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        try:
            owner = importlib.import_module(name)
            index = i
            break
        except ImportError as err:
            if not _is_missing(err, name):      # the module exists and its own import failed
                raise PatchError(f"patch target {target!r}: importing {name} failed: {err}") from err
    if owner is None:
        raise PatchError(f"patch target {target!r}: no importable module in its path")
    for part in parts[index:-1]:
        if not hasattr(owner, part):
            raise PatchError(f"patch target {target!r}: {owner!r} has no attribute {part!r}")
        owner = getattr(owner, part)
    attr = parts[-1]
    if _raw_get(owner, attr) is _MISSING:
        raise PatchError(f"patch target {target!r} does not exist (no attribute {attr!r} on {owner!r})")
    return owner, attr


def _resolve_object(path: str) -> Any:
    """A module or an attribute path such as 'pkg.mod.Class'."""
    try:
        return importlib.import_module(path)
    except ImportError:
        owner, attr = resolve(path)
        return getattr(owner, attr)


def _raw_get(owner: Any, attr: str) -> Any:
    """The attribute as stored (keeps staticmethod/classmethod descriptors on classes)."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attr in vars(klass):
                return vars(klass)[attr]
        return _MISSING
    return getattr(owner, attr, _MISSING)


def _import_hook_target(name: str) -> str:
    return f"sys.meta_path[{name}]"


def _unwrap_descriptor(value: Any) -> Any:
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


class PatchManager:
    """Applies, lists and removes patches. Not thread-safe: patch at start-up."""

    def __init__(self) -> None:
        self._applied: list[AppliedPatch] = []

    # -- applying -------------------------------------------------------------------------
    def replace(self, target: str, new: Any, *, reason: str = "", aliases: str | None = None) -> AppliedPatch:
        """Rebind `target` to `new`.

        aliases: a module-name prefix (e.g. "megatron") whose already-imported modules hold
        the same object under the same name (`from x import f`); those bindings are rebound too.
        """
        return self._apply(target, "replace", lambda original: new, reason, aliases)

    def wrap(self, target: str, wrapper: Callable[[Any], Any], *, reason: str = "",
             aliases: str | None = None) -> AppliedPatch:
        """Rebind `target` to `wrapper(original)`; the wrapper decides when to call the original."""
        return self._apply(target, "wrap", wrapper, reason, aliases)

    def define(self, target: str, value: Any, *, reason: str = "") -> AppliedPatch:
        """Create an attribute that does not exist yet (e.g. a name a module forgot to bind when
        an optional dependency is missing). Defining an existing attribute is an error."""
        owner_path, _, attr = target.rpartition(".")
        owner = _resolve_object(owner_path)
        if _raw_get(owner, attr) is not _MISSING:
            raise PatchError(f"cannot define {target!r}: it already exists (use replace or wrap)")
        if self.find(target) is not None:
            raise PatchError(f"patch target {target!r} is already patched; remove it first")
        record = AppliedPatch(target, "define", owner, attr, _MISSING, value, reason)
        setattr(owner, attr, value)
        self._applied.append(record)
        return record

    def provide_module(self, name: str, module: Any, *, reason: str = "") -> AppliedPatch:
        """Stand in for a module that cannot be imported on this machine (e.g. one that needs an
        optional accelerator package); removal takes it out of sys.modules again."""
        if name in sys.modules:
            raise PatchError(f"module {name!r} is already imported; patch its attributes instead")
        if self.find(name) is not None:
            raise PatchError(f"module {name!r} is already provided")
        sys.modules[name] = module
        record = AppliedPatch(name, "module", sys.modules, name, _MISSING, module, reason)
        self._applied.append(record)
        return record

    def setenv(self, name: str, value: str, *, reason: str = "") -> AppliedPatch:
        """Set an environment variable the host checks; removal restores the previous value."""
        target = f"os.environ[{name}]"
        if self.find(target) is not None:
            raise PatchError(f"{target} is already patched")
        record = AppliedPatch(target, "env", os.environ, name, os.environ.get(name, _MISSING), value, reason)
        os.environ[name] = value
        self._applied.append(record)
        return record

    def enter(self, name: str, context_manager: Any, *, reason: str = "") -> AppliedPatch:
        """Enter a process-wide context (e.g. a TorchFunctionMode); removal exits it."""
        if self.find(name) is not None:
            raise PatchError(f"context {name!r} is already entered")
        context_manager.__enter__()
        record = AppliedPatch(name, "context", None, "", context_manager, context_manager, reason)
        self._applied.append(record)
        return record

    def hook_imports(self, finder: Any, *, reason: str = "") -> AppliedPatch:
        """Put an import hook (a sys.meta_path finder with a `name`, e.g. import_hooks.AroundImport)
        first on sys.meta_path, so it sees each import before the standard finders; removal takes it
        off again. Listed as `sys.meta_path[name]`."""
        target = _import_hook_target(finder.name)
        if self.find(target) is not None:
            raise PatchError(f"import hook {finder.name!r} is already installed")
        sys.meta_path.insert(0, finder)
        record = AppliedPatch(target, "import", sys.meta_path, finder.name, _MISSING, finder, reason)
        self._applied.append(record)
        return record

    def has_import_hook(self, name: str) -> bool:
        return self.find(_import_hook_target(name)) is not None

    def _apply(self, target, kind, make_new, reason, aliases) -> AppliedPatch:
        owner, attr = resolve(target)
        if self.find(target) is not None:
            raise PatchError(f"patch target {target!r} is already patched; remove it first")
        raw = _raw_get(owner, attr)
        original = _unwrap_descriptor(raw)
        new = make_new(original)
        if isinstance(owner, type) and isinstance(raw, (staticmethod, classmethod)) \
                and not isinstance(new, (staticmethod, classmethod)):
            new = type(raw)(new)   # keep the descriptor kind of the original
        inherited = isinstance(owner, type) and attr not in vars(owner)
        record = AppliedPatch(target, kind, owner, attr, raw, new, reason, inherited=inherited)
        setattr(owner, attr, new)
        if aliases:
            record.aliases = self._rebind_aliases(original, attr, new, aliases, owner)
        self._applied.append(record)
        return record

    @staticmethod
    def _rebind_aliases(original, attr, new, prefix, owner) -> list:
        rebound = []
        for name, module in list(sys.modules.items()):
            if module is None or module is owner or not (name == prefix or name.startswith(prefix + ".")):
                continue
            if getattr(module, attr, _MISSING) is original:
                setattr(module, attr, new)
                rebound.append((module, attr, original))
        return rebound

    # -- listing and removing ---------------------------------------------------------------
    def applied(self) -> list[AppliedPatch]:
        return list(self._applied)

    def find(self, target: str) -> AppliedPatch | None:
        return next((p for p in self._applied if p.target == target), None)

    def describe(self) -> str:
        return "\n".join(p.describe() for p in self._applied) or "(no patches applied)"

    def remove(self, target: str) -> None:
        record = self.find(target)
        if record is None:
            raise PatchError(f"patch target {target!r} is not patched")
        self._restore(record)
        self._applied.remove(record)

    def remove_all(self) -> None:
        """Undo every patch, newest first, so stacked patches unwind correctly."""
        while self._applied:
            self._restore(self._applied.pop())

    @staticmethod
    def _restore(record: AppliedPatch) -> None:
        if record.kind == "context":
            record.original.__exit__(None, None, None)
            return
        if record.kind == "define":
            delattr(record.owner, record.attr)
            return
        if record.kind == "env":
            if record.original is _MISSING:
                os.environ.pop(record.attr, None)
            else:
                os.environ[record.attr] = record.original
            return
        if record.kind == "module":
            if sys.modules.get(record.attr) is record.new:
                del sys.modules[record.attr]
            return
        if record.kind == "import":
            sys.meta_path[:] = [finder for finder in sys.meta_path if finder is not record.new]
            return
        for module, attr, original in record.aliases:
            setattr(module, attr, original)
        if record.inherited:
            delattr(record.owner, record.attr)   # the original lives on a base class
        else:
            setattr(record.owner, record.attr, record.original)


#: the process-wide manager used by mindspeed.adapt()
GLOBAL_PATCHES = PatchManager()
