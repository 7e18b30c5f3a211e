"""--moe-fb-overlap / --overlap-moe-expert-parallel-comm / --delay-wgrad-compute: every combination
Megatron-Core's combined 1F1B (or upstream) cannot run is refused in one line before any work, the
good ones plan, and at EP 1 the flags are accepted with one line saying they do nothing. (The
computation: tests_extend/distributed/test_moe_fb_overlap.py.)"""
import re

import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan

MOE = ["--num-experts", "4"]
EP2 = ["--expert-model-parallel-size", "2"]
FB = ["--moe-fb-overlap"] + MOE + EP2
PP2 = ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]


@pytest.mark.parametrize("argv, message", [
    (FB + PP2, "--moe-fb-overlap at --pipeline-model-parallel-size 2 needs the interleaved schedule "
               "(--num-layers-per-virtual-pipeline-stage) or --schedules-method dualpipev"),
    (FB + ["--moe-token-dispatcher-type", "allgather"], "needs --moe-token-dispatcher-type alltoall (got allgather"),
    (FB + ["--moe-shared-expert-intermediate-size", "8", "--moe-shared-expert-overlap"],
     "does not combine with --moe-shared-expert-overlap"),
    (FB + ["--mtp-num-layers", "1"], "at most one MTP layer, and that one only at --pipeline-model-parallel-size > 1"),
    (["--overlap-moe-expert-parallel-comm", "--moe-token-dispatcher-type", "allgather"] + MOE + EP2,
     "--overlap-moe-expert-parallel-comm needs --moe-token-dispatcher-type alltoall"),
    (["--delay-wgrad-compute"] + MOE + EP2, "--delay-wgrad-compute needs --moe-fb-overlap"),
    (FB + ["--moe-alltoall-overlap-comm"], "does not combine with --moe-alltoall-overlap-comm"),
    (["--moe-fb-overlap"], "needs --num-experts (moe) to be on too"),
    (FB + ["--backend", "mindspore"], "lack AlltoAll"),
])
def test_combinations_it_cannot_honour_are_refused(argv, message):
    with pytest.raises(MindSpeedConfigError, match="MindSpeed: .*" + re.escape(message)) as info:
        plan(argv)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("argv", [
    FB,
    ["--overlap-moe-expert-parallel-comm"] + MOE + EP2,                          # Megatron-Core 0.16's own name
    FB + ["--delay-wgrad-compute"],
    # DeepSeek-V3's recipe: each layer's compute nodes recompute in their backward (fb_overlap_recompute.py)
    FB + ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    FB + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"],                 # the interleaved schedule
    FB + PP2 + ["--schedules-method", "dualpipev", "--untie-embeddings-and-output-weights"],   # the V's F-B slots
])
def test_good_combinations_plan(argv):
    assert "moe-fb-overlap" in {f.id for f in plan(argv).features}


def test_full_recompute_follows_megatrons_layer_choice():
    from types import SimpleNamespace

    from mindspeed.features.moe.fb_overlap_recompute import recomputed
    block = SimpleNamespace(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert [recomputed(block, i, decoder=True) for i in range(4)] == [True, True, False, False]
    assert recomputed(block, 3, decoder=False)          # MTP layers: as Megatron's MTP block, all of them
    uniform = SimpleNamespace(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert all(recomputed(uniform, i, decoder=True) for i in range(4))
    assert not recomputed(SimpleNamespace(recompute_granularity="selective"), 0, decoder=True)


def test_at_expert_parallel_size_1_it_is_noted_and_off():
    p = plan(["--moe-fb-overlap"] + MOE)
    assert [f.id for f, *_ in p.inert] == ["moe-fb-overlap"] and "moe-fb-overlap" not in {f.id for f in p.features}
    assert len(p.notes()) == 1 and "no all-to-all to overlap" in p.notes()[0]
    assert not p.args.moe_fb_overlap


def test_permutation_async_comm_under_the_overlap_is_noted_and_off():
    p = plan(FB + ["--moe-permutation-async-comm"])        # upstream's DeepSeek-V3 recipe has both
    assert [f.id for f, *_ in p.inert] == ["moe-permutation-async-comm"]
    assert "moe-fb-overlap" in {f.id for f in p.features} and "moe-permutation-async-comm" not in {
        f.id for f in p.features}
    assert len(p.notes()) == 1 and "run as nodes of Megatron-Core's combined step" in p.notes()[0]


def test_megatron_core_without_the_combined_schedule_is_named(monkeypatch):
    from mindspeed.features.moe import fb_overlap_feature
    monkeypatch.setattr(fb_overlap_feature, "COMBINED_1F1B", "megatron.core.pipeline_parallel.no_such_schedule")
    with pytest.raises(MindSpeedConfigError, match="runs Megatron-Core's combined 1F1B schedule, which Megatron-Core"
                                                   " .* lacks: use Megatron-LM core_v0.16.1"):
        plan(FB)
