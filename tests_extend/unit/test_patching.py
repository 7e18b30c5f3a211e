import types
import sys

import pytest

from mindspeed.patching import PatchError, PatchManager


@pytest.fixture
def target_module():
    mod = types.ModuleType("ms_patch_target")

    def greet(name):
        return f"hello {name}"

    class Base:
        def method(self):
            return "base"

        @staticmethod
        def static():
            return "static"

    class Child(Base):
        pass

    mod.greet, mod.Base, mod.Child = greet, Base, Child
    alias = types.ModuleType("ms_patch_target.user")
    alias.greet = greet            # as after `from ms_patch_target import greet`
    sys.modules["ms_patch_target"], sys.modules["ms_patch_target.user"] = mod, alias
    yield mod, alias
    del sys.modules["ms_patch_target"], sys.modules["ms_patch_target.user"]


def test_replace_and_wrap_are_listed_and_removable(target_module):
    mod, alias = target_module
    original = mod.greet
    pm = PatchManager()
    pm.wrap("ms_patch_target.greet", lambda orig: lambda name: orig(name).upper(), reason="shout",
            aliases="ms_patch_target")
    assert mod.greet("a") == "HELLO A" and alias.greet("a") == "HELLO A"
    pm.replace("ms_patch_target.Base.method", lambda self: "patched")
    assert mod.Child().method() == "patched"
    assert [p.kind for p in pm.applied()] == ["wrap", "replace"]
    assert "shout" in pm.describe()
    pm.remove_all()
    assert mod.greet is original and alias.greet is original
    assert mod.Child().method() == "base" and pm.applied() == []


def test_missing_target_is_an_error(target_module):
    pm = PatchManager()
    with pytest.raises(PatchError, match="does not exist"):
        pm.replace("ms_patch_target.no_such_function", lambda: None)
    with pytest.raises(PatchError, match="no importable module"):
        pm.replace("no_such_package_xyz.f", lambda: None)
    assert pm.applied() == []


def test_double_patch_is_an_error(target_module):
    pm = PatchManager()
    pm.replace("ms_patch_target.greet", lambda n: n)
    with pytest.raises(PatchError, match="already patched"):
        pm.replace("ms_patch_target.greet", lambda n: n)
    pm.remove_all()


def test_inherited_and_static_attributes_restore_exactly(target_module):
    mod, _ = target_module
    pm = PatchManager()
    pm.replace("ms_patch_target.Child.method", lambda self: "child")
    pm.replace("ms_patch_target.Base.static", lambda: "new static")
    assert mod.Child().method() == "child" and mod.Base().method() == "base"
    assert mod.Base.static() == "new static"
    pm.remove_all()
    assert "method" not in vars(mod.Child)            # lived on the base class before
    assert isinstance(vars(mod.Base)["static"], staticmethod)
    assert mod.Base.static() == "static"


def test_define_and_context(target_module):
    mod, _ = target_module
    pm = PatchManager()
    pm.define("ms_patch_target.new_name", 42)
    with pytest.raises(PatchError, match="already exists"):
        pm.define("ms_patch_target.greet", 1)
    events = []

    class Ctx:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    pm.enter("test-context", Ctx())
    assert mod.new_name == 42 and events == ["enter"]
    pm.remove_all()
    assert not hasattr(mod, "new_name") and events == ["enter", "exit"]


def test_setenv_restores_the_previous_value_or_absence(monkeypatch):
    monkeypatch.setenv("MS_PATCH_SET", "before")
    monkeypatch.delenv("MS_PATCH_NEW", raising=False)
    pm = PatchManager()
    pm.setenv("MS_PATCH_SET", "during", reason="r")
    pm.setenv("MS_PATCH_NEW", "1")
    import os
    assert os.environ["MS_PATCH_SET"] == "during" and os.environ["MS_PATCH_NEW"] == "1"
    assert "os.environ[MS_PATCH_SET]" in pm.describe()
    with pytest.raises(PatchError):
        pm.setenv("MS_PATCH_SET", "again")
    pm.remove_all()
    assert os.environ["MS_PATCH_SET"] == "before" and "MS_PATCH_NEW" not in os.environ


def test_provide_module_stands_in_and_is_removed():
    name = "ms_patch_absent_module"
    assert name not in sys.modules
    pm = PatchManager()
    stand_in = types.ModuleType(name)
    stand_in.value = 42
    pm.provide_module(name, stand_in, reason="optional dependency missing")
    import importlib
    assert importlib.import_module(name).value == 42
    with pytest.raises(PatchError):
        pm.provide_module(name, types.ModuleType(name))   # already there: patch its attributes instead
    pm.remove_all()
    assert name not in sys.modules


def test_a_target_whose_module_fails_to_import_names_the_failure(tmp_path, monkeypatch):
    """A module that exists but imports something missing (Megatron-LM's megatron.training without
    pydantic, on a GPU machine's own Python) is reported as such, not as an absent attribute of
    the package above it."""
    pkg = tmp_path / "ms_needs_dep"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "arguments.py").write_text("import ms_absent_dependency\n\ndef parse_args():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PatchError, match=r"importing ms_needs_dep.arguments failed: No module named "
                                         r"'ms_absent_dependency'"):
        PatchManager().wrap("ms_needs_dep.arguments.parse_args", lambda orig: orig)
    with pytest.raises(PatchError, match=r"ms_needs_dep.absent.parse_args.*has no attribute 'absent'"):
        PatchManager().wrap("ms_needs_dep.absent.parse_args", lambda orig: orig)
    for name in [m for m in sys.modules if m.startswith("ms_needs_dep")]:
        del sys.modules[name]



def test_an_import_hook_is_listed_first_on_meta_path_and_removed(tmp_path, monkeypatch):
    import contextlib
    import importlib
    from mindspeed.import_hooks import AroundImport
    (tmp_path / "ms_hooked_module.py").write_text("body_ran = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    events = []

    @contextlib.contextmanager
    def around(module):                   # encloses the module's body
        events.append(("before", module.__name__, hasattr(module, "body_ran")))
        yield
        events.append(("after", module.__name__, hasattr(module, "body_ran")))

    hook = AroundImport("ms-test-hook", "ms_hooked_module".__eq__, around)
    pm = PatchManager()
    pm.hook_imports(hook, reason="why it is there")
    try:
        assert sys.meta_path[0] is hook and pm.has_import_hook("ms-test-hook")
        assert pm.describe() == "import  sys.meta_path[ms-test-hook] - why it is there"
        with pytest.raises(PatchError, match="already installed"):
            pm.hook_imports(AroundImport("ms-test-hook", "ms_hooked_module".__eq__, around))
        assert importlib.import_module("ms_hooked_module").body_ran
        assert events == [("before", "ms_hooked_module", False), ("after", "ms_hooked_module", True)]
    finally:
        pm.remove("sys.meta_path[ms-test-hook]")
        sys.modules.pop("ms_hooked_module", None)
    assert all(finder is not hook for finder in sys.meta_path)
    assert not pm.has_import_hook("ms-test-hook") and pm.applied() == []
    assert importlib.import_module("ms_hooked_module").body_ran     # imported again, without the hook
    sys.modules.pop("ms_hooked_module", None)
    assert len(events) == 2
