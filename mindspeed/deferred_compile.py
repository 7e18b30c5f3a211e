"""Megatron's import-time torch.compile, deferred to the first call.

Megatron decorates its fusion functions with `torch.compile` (megatron/core/jit.py's `jit_fuser`)
while its modules are imported. Each decoration imports TorchDynamo and TorchInductor: about 4 s of
every rank's start on this machine, paid even by runs that never call a compiled function (CPU,
fusions off). While a `megatron` module executes, `torch.compile(fn)` returns a wrapper that calls
the real `torch.compile(fn)` on its first call. Nothing compiles earlier or later than it would
have: torch.compile never compiles before the first call either.

`install()` (from `import mindspeed`) adds the import hook; it imports nothing, and it changes
nothing for a megatron already imported or for calls made after the import.
"""
import functools
import importlib.abc
import inspect
import sys
import threading

_DEPTH = threading.local()


def _deferring(real_compile):
    def compile_on_first_call(model=None, **options):
        if model is None:                                   # @torch.compile(fullgraph=True, ...)
            return lambda fn: compile_on_first_call(fn, **options)
        if not inspect.isfunction(model):                   # modules and callables: torch's own object
            return real_compile(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **options)
            return compiled(*args, **kwargs)
        return call
    compile_on_first_call.real_compile = real_compile
    return compile_on_first_call


class _DeferringLoader(importlib.abc.Loader):
    """The module's own loader; torch.compile is deferred while the module body runs."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):          # get_source, get_resource_reader, ...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        import torch                      # megatron's first line does the same
        depth = getattr(_DEPTH, "value", 0)
        if depth == 0:
            torch.compile = _deferring(torch.compile)
        _DEPTH.value = depth + 1
        try:
            self._loader.exec_module(module)
        finally:
            _DEPTH.value = depth
            if depth == 0:
                torch.compile = torch.compile.real_compile


class _MegatronFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "megatron" and not name.startswith("megatron."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _DeferringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    if not any(isinstance(f, _MegatronFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MegatronFinder())
