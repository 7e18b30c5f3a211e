import json
import os
import subprocess
import sys

import pytest

from mindspeed import readme, support_matrix
from mindspeed.backends.base import Level
from mindspeed.features.registry import all_features

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mindspeed", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_matrix_cli_lists_both_backends():
    out = _cli("matrix")
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines()[0]
    for column in ("torch/cpu", "torch/npu", "mindspore/cpu", "mindspore/ascend"):
        assert column in header
    data = json.loads(_cli("matrix", "--json").stdout)
    assert {"torch/cpu", "mindspore/cpu"} <= set(data["verified"])
    assert "torch/npu" not in data["verified"]
    assert {row["feature"] for row in data["features"]} == {f.id for f in all_features() if not f.planned}
    assert {row["feature"] for row in data["not_implemented_yet"]} == {f.id for f in all_features() if f.planned}
    assert "dualpipev" in {row["feature"] for row in data["not_implemented_yet"]}


def test_readme_tables_match_the_code():
    stale = readme.drift()
    assert stale == [], (f"generated docs sections are stale ({stale}): run `python -m mindspeed docs` "
                         "(alias `readme`), which rewrites docs/support-matrix.md and docs/flags.md")


def test_unsupported_feature_exits_nonzero_with_full_message():
    out = _cli("check", "--backend", "mindspore", "--lora-target-modules", "linear_qkv")
    assert out.returncode != 0
    msg = out.stderr
    assert "lora" in msg                              # the feature
    assert "backend 'mindspore'" in msg               # the backend
    assert "host.megatron_core" in msg                # the missing capability
    assert "Alternative:" in msg and "Supported on: torch/cpu" in msg


def test_every_refused_cell_names_what_is_missing():
    for feature in all_features():
        for backend, device in support_matrix.columns():
            level, limits = support_matrix.feature_level(feature, backend, device)
            if level is Level.ABSENT:
                assert limits, f"{feature.id} on {backend}/{device} is refused without a reason"
                with pytest.raises(support_matrix.UnsupportedFeatureError, match=feature.id):
                    support_matrix.check([feature], backend, device)
            else:
                support_matrix.check([feature], backend, device)


def test_conflicts_and_dependencies_are_errors():
    from mindspeed.features.base import Feature, FeatureConfigError
    from mindspeed.features import registry
    from mindspeed.flags.mindspeed_flags import defaults

    class A(Feature):
        id, flags, conflicts = "test-a", (), ("test-b",)

        def enabled(self, args):
            return True

    class B(A):
        id, conflicts, depends = "test-b", (), ("test-missing",)

    saved = dict(registry._REGISTRY)
    try:
        registry.register(A)
        registry.register(B)
        with pytest.raises(FeatureConfigError) as err:
            registry.enabled_features(defaults())
        assert "conflicts with 'test-b'" in str(err.value) and "needs 'test-missing'" in str(err.value)
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)


def test_muon_refusal_reason_holds_here():
    """The muon-optimizer row is refused on torch because Megatron-Core's Muon cannot be built on this
    install (emerging-optimizers needs Python >= 3.12). Where it can, this fails: wire
    get_megatron_muon_optimizer into training/pretrain.py and lift the row's torch cell."""
    import sys
    from megatron.core.optimizer import muon
    assert not muon.HAVE_EMERGING_OPTIMIZERS and sys.version_info < (3, 12)
