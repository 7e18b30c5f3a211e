"""Megatron's import-time torch.compile decorations are deferred to the first call: importing
Megatron-Core after an entry point installed the deferral leaves TorchDynamo/Inductor unimported, a
decorated function still runs compiled, and torch.compile is torch's own again once the import is
over. The deferral is a listed, removable patch of GLOBAL_PATCHES that the entry points install;
`import mindspeed` alone installs nothing. Each check runs in a fresh interpreter (the point is what
an import pulls in)."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INSTALL = ("from mindspeed import deferred_compile\n"
           "from mindspeed.patching import GLOBAL_PATCHES\n"
           "deferred_compile.install(GLOBAL_PATCHES)\n")


def _run(code, path=()):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, ROOT]))
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, env=env, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()


def _standin_megatron(root, body=""):
    """A stand-in megatron package (the hook is about names): `compile_seen` is the torch.compile its
    body saw."""
    (root / "megatron").mkdir()
    (root / "megatron" / "__init__.py").write_text("import torch\n\ncompile_seen = torch.compile\n"
                                                   + textwrap.dedent(body))
    return str(root)


@pytest.fixture
def standin_megatron(tmp_path):
    return _standin_megatron(tmp_path)


@pytest.fixture
def standin_megatron_compiling(tmp_path):
    """`plus` says whether Dynamo traced it (the eager backend compiles in no time)."""
    return _standin_megatron(tmp_path, """
        @torch.compile(backend="eager", fullgraph=True)
        def plus(x):
            return x + (1 if torch.compiler.is_compiling() else 100)
    """)


def test_import_mindspeed_alone_patches_nothing(standin_megatron):
    out = _run("""
        import sys
        meta_path = list(sys.meta_path)
        import mindspeed
        print(sys.meta_path == meta_path, "torch" in sys.modules)
        import torch
        real = torch.compile
        import megatron
        print(megatron.compile_seen is real, torch.compile is real)
    """, path=[standin_megatron])
    assert out == ["True", "False", "True", "True"]


def test_megatron_core_import_leaves_dynamo_and_inductor_out():
    out = _run(INSTALL + textwrap.dedent("""
        import sys, megatron.core, torch
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
        print("torch._dynamo" in sys.modules, "torch._inductor" in sys.modules,
              torch.compile.__name__, bias_swiglu.__wrapped__.__name__)
    """))
    assert out == ["False", "False", "compile", "bias_swiglu"]


def test_a_decorated_function_runs_compiled_on_first_call(standin_megatron_compiling):
    out = _run(INSTALL + textwrap.dedent("""
        import sys, torch, megatron
        before = "torch._dynamo" in sys.modules
        print(before, int(megatron.plus(torch.zeros(1)).item()), "torch._dynamo" in sys.modules)
    """), path=[standin_megatron_compiling])
    assert out == ["False", "1", "True"]       # 1: traced by Dynamo, not run eagerly


def test_the_deferral_is_a_listed_patch_installed_once_and_removable(standin_megatron):
    out = _run(INSTALL + textwrap.dedent("""
        import sys
        deferred_compile.install(GLOBAL_PATCHES)          # a second entry point on the way: nothing more
        hooks = [f for f in sys.meta_path if getattr(f, "name", None) == deferred_compile.HOOK_NAME]
        print(len(hooks), sys.meta_path[0] is hooks[0])
        print(GLOBAL_PATCHES.describe() == "import  sys.meta_path[deferred-compile] - " + deferred_compile.REASON)
        GLOBAL_PATCHES.remove_all()
        import torch
        real = torch.compile
        import megatron
        print(hooks[0] in sys.meta_path, megatron.compile_seen is real)
    """), path=[standin_megatron])
    # removed: not on sys.meta_path, and a megatron imported afterwards sees torch's own torch.compile
    assert out == ["1", "True", "True", "False", "True"]


PRETRAIN = os.path.join(ROOT, "tests_extend", "example", "pretrain_gpt.py")
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
        "--train-iters", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]


def test_the_trainer_defers_megatrons_compiles(tmp_path):
    """The built-in trainer's process up to its first data read (a dataset that does not exist: the
    run stops there, exit 2): Megatron-Core is imported, TorchDynamo is not."""
    out = _run(f"""
        import runpy, sys
        main = runpy.run_path({PRETRAIN!r})["main"]       # not __main__: main is only defined
        code = main({TINY!r} + ["--data-path", {str(tmp_path / "absent")!r}])
        print(code, "megatron.core" in sys.modules, "torch._dynamo" in sys.modules)
    """)
    assert out[-3:] == ["2", "True", "False"]


@pytest.mark.parametrize("cli", ["mindspeed.generate", "mindspeed.evaluate"])
def test_the_inference_clis_defer_megatrons_compiles(cli):
    """`python -m mindspeed.generate|evaluate` import Megatron-Core with their cli module."""
    out = _run(f"""
        import runpy, sys
        runpy.run_module({cli!r})                         # not __main__: the imports only
        print("megatron.core" in sys.modules, "torch._dynamo" in sys.modules)
    """)
    assert out == ["True", "False"]
