import os
import re
import subprocess
import sys

import pytest

import mindspeed
from mindspeed.adaptor_core import MindSpeedConfigError, plan
from mindspeed.patching import _raw_get

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_unadapt_restores_every_patched_attribute():
    import megatron.core.tensor_parallel.random as mrandom  # noqa: F401  (import before snapshot)
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import torch
    _missing = object()
    gemm_before = getattr(moe_utils, "te_general_gemm", _missing)
    current_device_before = torch.cuda.current_device
    state = mindspeed.adapt([])
    # on CPU the device shim replaces torch.cuda.current_device and, when Transformer Engine is
    # absent, defines moe_utils.te_general_gemm (Megatron reads it even then)
    assert torch.cuda.current_device is not current_device_before
    if gemm_before is _missing:
        assert moe_utils.te_general_gemm is None
    records = state.patcher.applied()
    assert len(records) >= 8, state.patcher.describe()
    before = [(r.owner, r.attr, r.original, [(m, a, o) for m, a, o in r.aliases]) for r in records
              if r.kind in ("replace", "wrap")]
    assert any(r.target.startswith("megatron.") for r in records)
    mindspeed.unadapt()
    for owner, attr, original, aliases in before:
        assert _raw_get(owner, attr) is original, f"{owner}.{attr} not restored"
        for module, name, alias_original in aliases:
            assert getattr(module, name) is alias_original
    # what was defined is gone again, what was replaced is the original object again
    assert getattr(moe_utils, "te_general_gemm", _missing) is gemm_before
    assert torch.cuda.current_device is current_device_before
    assert state.patcher.applied() == []


def test_adapt_twice_does_not_stack_patches():
    first = len(mindspeed.adapt([]).patcher.applied())
    second = len(mindspeed.adapt([]).patcher.applied())
    mindspeed.unadapt()
    assert first == second


def test_import_hook_reads_only_mindspeed_flags():
    code = "import mindspeed.megatron_adaptor as m; print(m.SESSION.plan.backend, m.SESSION.device, len(m.SESSION.patcher.applied()))"
    out = subprocess.run([sys.executable, "-c", code, "--num-layers", "2", "--optimization-level", "1",
                          "--tensor-model-parallel-size", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    backend, device, patches = out.stdout.split()
    assert (backend, device) == ("torch", "cpu") and int(patches) >= 8


def test_import_hook_refuses_unsupported_before_work():
    code = "import mindspeed.megatron_adaptor; print('SHOULD NOT RUN')"
    out = subprocess.run([sys.executable, "-c", code, "--backend", "mindspore",
                          "--swap-optimizer"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "SHOULD NOT RUN" not in out.stdout
    assert "swap-optimizer" in out.stderr and "mindspore" in out.stderr


def test_bad_values_are_reported():
    with pytest.raises(MindSpeedConfigError, match="disagree"):
        plan(["--backend", "torch", "--ai-framework", "mindspore"])
    with pytest.raises(MindSpeedConfigError, match="not available"):
        plan(["--device", "cuda"])


@pytest.mark.parametrize("argv, message", [
    (["--profile-ranks", "1"], "--profile-ranks has no effect without --profile (profile): add it or drop"),
    # at CP > 1 under another algorithm (at CP 1 every CP flag is inert: test_inert_flags.py)
    (["--context-parallel-size", "2", "--cp-window-size", "2"], "--cp-window-size has no effect"),
    (["--context-parallel-size", "2", "--context-parallel-algo", "kvallgather_cp_algo", "--cp-window-size", "2"],
     "--cp-window-size has no effect"),
    (["--context-parallel-size", "2", "--ulysses-degree-in-cp", "2"],
     "--ulysses-degree-in-cp has no effect without --context-parallel-size > 1 (--context-parallel-algo hybrid_cp_algo)"),
])
def test_sub_flag_without_its_feature_is_refused(argv, message):
    """A sub-flag set while its feature is off would be accepted and ignored (a feature that is on but
    has no effect in the layout takes its sub-flags, and says so: test_inert_flags.py)."""
    with pytest.raises(MindSpeedConfigError, match=re.escape(message)):
        plan(argv)
    plan(["--profile", "--profile-ranks", "1"])       # with its feature on, the same sub-flag is taken


def test_ai_framework_alias_and_namespace_input():
    import argparse
    assert plan(["--ai-framework", "pytorch"]).backend == "torch"
    ns = argparse.Namespace(tensor_model_parallel_size=2, num_layers=4)   # e.g. Megatron's args
    p = plan(ns)
    assert [f.id for f in p.features] == ["tensor-parallel"]
    assert p.args.num_layers == 4
