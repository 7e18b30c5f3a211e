"""The plan's namespace holds every host (Megatron) flag a feature reads, at its one default (the
feature's host Flag, or megatron_defaults.HOST_FLAG_DEFAULTS): features read attributes, whether the
flags came from a whole command line, a partial one, or a user's own Namespace."""
import argparse

import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan
from mindspeed.features.host_flags import ABSENT_UNTIL_GIVEN
from mindspeed.features.registry import all_features
from mindspeed.flags.mindspeed_flags import defaults, host_flag_defaults, mindspeed_parser, parse_mindspeed_args
from mindspeed.megatron_defaults import HOST_FLAG_DEFAULTS


def test_each_host_default_is_defined_once():
    declared = {fl.dest for f in all_features() for fl in f.flags if fl.host}
    own = {action.dest for action in mindspeed_parser()._actions}
    assert not set(HOST_FLAG_DEFAULTS) & declared, "a host flag's default in its Flag and in megatron_defaults"
    assert not set(HOST_FLAG_DEFAULTS) & own, "MindSpeed's own flag listed as a host flag"


def test_defaults_hold_every_host_flag_except_those_absent_until_given():
    ns = vars(defaults())
    for dest, value in host_flag_defaults().items():
        if dest in ABSENT_UNTIL_GIVEN:
            assert dest not in ns, dest     # --moe-grouped-gemm's check tells absent from a dense model
        else:
            assert ns[dest] == value, dest
    assert ns["seq_length"] is None and ns["moe_token_dispatcher_type"] == "alltoall" and ns["swiglu"] is True


def test_a_partial_command_line_keeps_what_it_gives_and_fills_the_rest():
    ns = parse_mindspeed_args(["--seq-length", "64", "--num-experts", "4"], unknown="error")
    assert (ns.seq_length, ns.num_experts) == (64, 4)
    assert ns.num_layers is None and ns.neat_pack is False and ns.fp16 is False
    assert not hasattr(ns, "bf16")


def test_a_users_namespace_is_read_with_the_host_defaults_it_lacks():
    """Megatron's args, or a user's own: a flag it gives is checked, the ones it lacks are the host's."""
    ring = dict(context_parallel_size=2, context_parallel_algo="megatron_cp_algo")
    p = plan(argparse.Namespace(**ring))
    assert [f.id for f in p.features] == ["megatron-cp-algo"] and p.args.seq_length is None
    with pytest.raises(MindSpeedConfigError, match="megatron_cp_algo"):
        plan(argparse.Namespace(**ring, seq_length=6))      # not a multiple of 2 x CP
