"""What a Megatron-Core test module imports from Transformer Engine at module level, where TE is absent.

Several of Megatron's test files import TE names at their top (`from transformer_engine.pytorch.fp8
import check_fp8_support`, `import transformer_engine as te`) although most of their tests never use
them: without TE none of their tests is collected. The plugin imports each test module with an
`__import__` of its own (the module's `__builtins__`), which answers those imports with a stand-in
and every other import as Python does. Megatron's own modules keep the real import: they still find
TE absent, and the stand-in never enters sys.modules.

The stand-in answers TE's capability probes (`check_fp8_support` and its kin) "not supported", as TE
does on a GPU without FP8; any other name is a placeholder that raises TransformerEngineAbsent when
a test calls it or reads from it, so the plugin reports that test skipped as needing TE.
"""
from __future__ import annotations

import builtins
import types

TE_PACKAGES = ("transformer_engine", "transformer_engine_torch")
ABSENT = "Transformer Engine is not installed (MindSpeed's import stand-in for a test module)"


class TransformerEngineAbsent(ImportError):
    """A test used a Transformer Engine name; TE is not installed."""


def _unsupported(*args, **kwargs):
    return False, ABSENT


class _Placeholder:
    """A TE name a test module imported: unusable, saying why."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise TransformerEngineAbsent(f"{self._name}: {ABSENT}")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr.startswith("check_") and attr.endswith("_support"):
            return _unsupported            # TE's capability probes: FP8 / MXFP8 / block scaling
        return _Placeholder(f"{self._name}.{attr}")

    def __instancecheck__(self, obj):
        return False      # `isinstance(t, Float8Tensor)`: nothing is an instance of an absent TE class

    def __subclasscheck__(self, cls):
        return False

    def __mro_entries__(self, bases):
        raise TransformerEngineAbsent(f"subclassing {self._name}: {ABSENT}")


def _stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name, ABSENT)
    placeholder = _Placeholder(name)
    module.__getattr__ = placeholder.__getattr__
    module.__path__ = []                   # a package: `from transformer_engine.pytorch import x`
    return module


def _is_te(name: str) -> bool:
    return name.split(".", 1)[0] in TE_PACKAGES


def standin_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.split(".", 1)[0] in TE_PACKAGES:
        try:
            return builtins.__import__(name, globals, locals, fromlist, level)
        except ImportError:
            # `from a.b import c` reads c from a.b; `import a.b` binds a (and reads b from it)
            return _stand_in(name if fromlist else name.split(".", 1)[0])
    return builtins.__import__(name, globals, locals, fromlist, level)


def test_module_builtins() -> dict:
    """The `__builtins__` a test module is executed with."""
    return dict(vars(builtins), __import__=standin_import)
