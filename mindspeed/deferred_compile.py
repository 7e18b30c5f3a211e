"""Megatron's import-time torch.compile, deferred to the first call.

Megatron decorates its fusion functions with `torch.compile` (megatron/core/jit.py's `jit_fuser`)
while its modules are imported. Each decoration imports TorchDynamo and TorchInductor: about 4 s of
every rank's start on this machine, paid even by runs that never call a compiled function (CPU,
fusions off). While a `megatron` module executes, `torch.compile(fn)` returns a wrapper that calls
the real `torch.compile(fn)` on its first call. Nothing compiles earlier or later than it would
have: torch.compile never compiles before the first call either.

`install(patcher)` adds the import hook as one of `patcher`'s patches (listed with its reason,
removed with the others). It imports nothing, and it changes nothing for a megatron already
imported or for calls made after the import. `import mindspeed` alone does not call it: each entry
point that may import Megatron does, first (mindspeed.adapt, mindspeed.megatron_adaptor, the pytest
plugin, the built-in trainers' pretrain_gpt.py, `python -m mindspeed.generate|evaluate|data` and
the converter's main).
"""
import contextlib
import functools
import inspect
import threading

from mindspeed import import_hooks

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


@contextlib.contextmanager
def _compile_deferred(module):
    """torch.compile is deferred while a megatron module's body runs (nested imports included)."""
    import torch                      # megatron's first line does the same
    depth = getattr(_DEPTH, "value", 0)
    if depth == 0:
        torch.compile = _deferring(torch.compile)
    _DEPTH.value = depth + 1
    try:
        yield
    finally:
        _DEPTH.value = depth
        if depth == 0:
            torch.compile = torch.compile.real_compile


def _is_megatron(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.")


HOOK_NAME = "deferred-compile"
REASON = "Megatron's import-time torch.compile decorations compile on first call (TorchDynamo's import: ~4 s a rank)"


def install(patcher) -> None:
    """Before Megatron's import; a second call (another entry point on the way) changes nothing."""
    if not patcher.has_import_hook(HOOK_NAME):
        patcher.hook_imports(import_hooks.AroundImport(HOOK_NAME, _is_megatron, _compile_deferred), reason=REASON)
