"""Megatron's import-time torch.compile decorations are deferred to the first call: importing
Megatron-Core through MindSpeed leaves TorchDynamo/Inductor unimported, a decorated function still
runs compiled, and torch.compile is torch's own again once the import is over. Each check runs in a
fresh interpreter (the point is what an import pulls in)."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code, path=()):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, ROOT]))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()


def test_megatron_core_import_leaves_dynamo_and_inductor_out():
    out = _run("""
        import sys, mindspeed, megatron.core, torch
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
        print("torch._dynamo" in sys.modules, "torch._inductor" in sys.modules,
              torch.compile.__name__, bias_swiglu.__wrapped__.__name__)
    """)
    assert out == ["False", "False", "compile", "bias_swiglu"]


def test_a_decorated_function_runs_compiled_on_first_call(tmp_path):
    # a stand-in megatron package: the hook is about names, and the eager backend compiles in no time
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text(textwrap.dedent("""
        import torch

        @torch.compile(backend="eager", fullgraph=True)
        def plus(x):
            return x + (1 if torch.compiler.is_compiling() else 100)
    """))
    out = _run("""
        import sys, mindspeed, torch, megatron
        before = "torch._dynamo" in sys.modules
        print(before, int(megatron.plus(torch.zeros(1)).item()), "torch._dynamo" in sys.modules)
    """, path=[str(tmp_path)])
    assert out == ["False", "1", "True"]       # 1: traced by Dynamo, not run eagerly
