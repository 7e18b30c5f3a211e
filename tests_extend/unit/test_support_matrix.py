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
    assert {row["feature"] for row in data["features"]} == {f.id for f in all_features()
                                                            if not f.planned and not f.by_design}
    assert {row["feature"] for row in data["not_implemented_yet"]} == {f.id for f in all_features() if f.planned}
    assert "automated-pipeline" in {row["feature"] for row in data["not_implemented_yet"]}
    assert {row["feature"] for row in data["refused_by_design"]} == {f.id for f in all_features() if f.by_design}


# each row refused by design, by a flag of it: the one line says so, why, and what to use instead
BY_DESIGN = {
    ("--use-pipe-experts",): ("pipe-experts", "legacy (non-Megatron-Core) models", "--moe-alltoall-overlap-comm"),
    ("--use-nanopipe-swap",): ("nanopipe", "legacy (non-Megatron-Core) models", "interleaved pipeline"),
    ("--adaptive-recompute-device-swap",): ("adaptive-recompute-device-swap", "legacy (non-Megatron-Core) models",
                                            "--swap-attention"),
    ("--virtual-optimizer", "all"): ("virtual-optimizer", "torch_npu.empty_with_swapped_memory", "--swap-optimizer"),
}


@pytest.mark.parametrize("argv", list(BY_DESIGN), ids=lambda argv: argv[0])
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_refused_by_design_in_one_line_naming_why_and_the_alternative(argv, backend):
    from mindspeed.adaptor_core import MindSpeedConfigError, plan
    feature_id, why, instead = BY_DESIGN[argv]
    with pytest.raises(MindSpeedConfigError) as err:
        plan(["--backend", backend, *argv], unknown_flags="trainer")
    msg = str(err.value)
    assert "\n" not in msg and f"{' '.join(argv)} ({feature_id}) is refused by design: " in msg, msg
    assert why in msg and instead in msg.split("; instead: ")[1] and "not implemented yet" not in msg, msg
    markdown = support_matrix.to_markdown()
    assert f"- {feature_id} (" in markdown.split("Refused by design")[1]
    assert feature_id not in [row["feature"] for row in support_matrix.compute()]


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
