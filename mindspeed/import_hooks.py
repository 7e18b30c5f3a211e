"""Code run around one module's body when it is first imported: a meta path finder that asks the
other finders for the module and hands their loader back wrapped. Imports nothing itself; it goes
on sys.meta_path as a patch (PatchManager.hook_imports), listed and removable like the others."""
import importlib.abc
import sys


class _AroundLoader(importlib.abc.Loader):
    """The module's own loader; `around(module)` (a context manager) encloses the module's body."""

    def __init__(self, loader, around):
        self._loader = loader
        self._around = around

    def __getattr__(self, name):          # get_source, get_resource_reader, ...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        with self._around(module):
            self._loader.exec_module(module)


class AroundImport(importlib.abc.MetaPathFinder):
    """For each module `wanted(name)` accepts, run its body inside `around(module)`; `name` tells
    this hook from the others."""

    def __init__(self, name, wanted, around):
        self.name = name
        self.wanted = wanted
        self.around = around

    def find_spec(self, name, path, target=None):
        if not self.wanted(name):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AroundLoader(spec.loader, self.around)
                return spec
        return None

