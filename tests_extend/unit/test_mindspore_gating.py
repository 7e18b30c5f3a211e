"""Every feature the support matrix marks unsupported (absent) on mindspore/cpu is refused by the
MindSpore trainer's entry with the gating message, before any backend or model exists."""
import pytest

from mindspeed.backends.base import Level
from mindspeed.features.registry import all_features
from mindspeed.support_matrix import feature_level

# what a feature needs beside its own flag to pass the argument parser's own checks
COMPANIONS = {"moe-grouped-gemm": ["--num-experts", "4"], "expert-parallel": ["--num-experts", "4"],
              "fused-moe-token-permute-and-unpermute": ["--num-experts", "4"]}
REFUSED = [f for f in all_features() if feature_level(f, "mindspore", "cpu")[0] is Level.ABSENT]


def _enabling_argv(feature):
    flag = feature.flags[0]
    return [flag.name] if flag.kwargs.get("action") == "store_true" else [flag.name, "2"]


def test_the_matrix_refuses_something_on_mindspore():
    assert len(REFUSED) >= 3


@pytest.mark.parametrize("feature", REFUSED, ids=[f.id for f in REFUSED])
def test_refused_with_gating_message(feature):
    from mindspeed import backends
    from mindspeed.adaptor_core import MindSpeedConfigError
    from mindspeed.training.arguments import parse_args
    from mindspeed.training.mindspore.trainer import setup
    argv = ["--backend", "mindspore", "--mock-data"] + _enabling_argv(feature) + COMPANIONS.get(feature.id, [])
    args = parse_args(argv, world_size=2)
    assert feature.enabled(args)
    backends.reset_backend()
    with pytest.raises(MindSpeedConfigError) as err:
        setup(args)
    msg = str(err.value)
    assert f"feature '{feature.id}'" in msg and "backend 'mindspore'" in msg and "missing capability" in msg
    assert backends._active is None        # refused before a backend was created
