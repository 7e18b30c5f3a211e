"""--moe-zero-memory level0|level1: what it cannot honour is refused in one line before any work
(upstream's rule: it needs the all-to-all overlap to hide under), the good ones plan, and at expert
parallel size 1 it is accepted with one line saying it has nothing to hide under. (The
computations, bitwise against the overlap alone: tests_extend/distributed/test_moe_comm.py.)"""
import re

import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan

MOE_EP2 = ["--num-experts", "4", "--expert-model-parallel-size", "2"]
OVERLAP = ["--moe-alltoall-overlap-comm"]


@pytest.mark.parametrize("argv, message", [
    (["--moe-zero-memory", "level0"] + MOE_EP2, "add --moe-alltoall-overlap-comm (or --moe-fb-overlap), as upstream"),
    (["--moe-zero-memory", "level1", "--moe-zero-memory-num-layers", "0"] + OVERLAP + MOE_EP2,
     "--moe-zero-memory-num-layers must be in 1..--num-layers"),
    (["--moe-zero-memory", "level1", "--moe-zero-memory-num-layers", "3", "--num-layers", "2"] + OVERLAP + MOE_EP2,
     "--moe-zero-memory-num-layers must be in 1..--num-layers (2), got 3"),
    (["--moe-zero-memory", "level0", "--recompute-granularity", "full", "--recompute-method", "uniform"]
     + OVERLAP + MOE_EP2, "full recompute already keeps no activation inside a layer"),
    (["--moe-zero-memory", "level0", "--moe-grouped-gemm", "--bf16"] + OVERLAP + MOE_EP2, "use level1"),
    (["--backend", "mindspore", "--moe-zero-memory", "level0"] + OVERLAP + MOE_EP2,
     "has no chunked all-to-all pipeline to hide the recompute under"),
])
def test_what_it_cannot_honour_is_refused_in_one_line(argv, message):
    with pytest.raises(MindSpeedConfigError, match="MindSpeed: .*" + re.escape(message)) as info:
        plan(argv)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("level", ["level0", "level1"])
def test_with_the_overlap_it_plans(level):
    p = plan(["--moe-zero-memory", level, "--moe-zero-memory-num-layers", "1"] + OVERLAP + MOE_EP2)
    assert {"moe-zero-memory", "moe-alltoall-overlap-comm"} <= {f.id for f in p.features}
    assert p.args.moe_zero_memory == level and p.args.moe_zero_memory_num_layers == 1


def test_at_expert_parallel_size_1_it_is_noted_and_off():
    p = plan(["--moe-zero-memory", "level1", "--num-experts", "4"] + OVERLAP)
    assert [f.id for f, *_ in p.inert] == ["moe-alltoall-overlap-comm", "moe-zero-memory"]
    assert any("no all-to-all to hide the recompute under" in note for note in p.notes())
    assert p.args.moe_zero_memory == "disable"       # the rest of the run sees it off
