"""--schedules-method dualpipev: upstream's limits refused in one line before any work, the inert
--dualpipev-dw-detach, the MindSpore and Megatron-LM refusals, and the V's layer numbering hook.
(Training with it: tests_extend/distributed/test_dualpipev.py.)"""
import re

import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan

ON = ["--schedules-method", "dualpipev", "--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--global-batch-size", "4", "--micro-batch-size", "1"]
UNTIED = ["--untie-embeddings-and-output-weights"]


@pytest.mark.parametrize("argv, message", [
    (["--schedules-method", "dualpipev", "--num-layers", "4"] + UNTIED,
     "needs --pipeline-model-parallel-size >= 2, got 1"),
    (ON, "needs --untie-embeddings-and-output-weights"),
    (ON + UNTIED + ["--context-parallel-size", "2"], "with --context-parallel-size > 1"),
    (ON + UNTIED + ["--num-layers-per-virtual-pipeline-stage", "2"],
     "leave out --num-layers-per-virtual-pipeline-stage"),
    (ON + UNTIED + ["--num-layer-list", "3,5"], "leave out --num-layer-list"),
    (ON + UNTIED + ["--overlap-grad-reduce"], "overlap-grad-reduce"),
    (ON + UNTIED + ["--tp-2d"], "tp-2d"),
    (ON + UNTIED + ["--num-layers", "6"], "splits --num-layers 6 over 2 x PP = 4 stages: give a multiple of 4"),
    (ON + UNTIED + ["--global-batch-size", "2"], "needs at least 2 x PP - 1 = 3 micro-batches per step, got 2"),
    (ON + UNTIED + ["--rampup-batch-size", "2", "2", "100"], "with --rampup-batch-size"),
    (ON + UNTIED + ["--backend", "mindspore"], "no point-to-point sends and receives on their own"),
])
def test_what_dualpipev_cannot_run_is_refused_in_one_line(argv, message):
    with pytest.raises(MindSpeedConfigError) as err:
        plan(argv)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_smallest_v_is_accepted_and_dw_detach_alone_is_inert():
    assert "dualpipev" in [f.id for f in plan(ON + UNTIED + ["--global-batch-size", "3"]).features]
    assert "dualpipev" in [f.id for f in plan(ON + UNTIED + ["--mtp-num-layers", "1"]).features]   # on the V's end
    detach_alone = plan(["--dualpipev-dw-detach"])
    assert "dualpipev" not in [f.id for f in detach_alone.features]
    assert [(f.id, why) for f, why, _ in detach_alone.inert] == [
        ("dualpipev", "without --schedules-method dualpipev there is no V cool-down to detach")]


def test_dw_detach_under_fb_overlap_is_accepted_with_one_line(caplog):
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    fb = ["--moe-fb-overlap", "--num-experts", "4", "--expert-model-parallel-size", "2", "--global-batch-size", "8"]
    with caplog.at_level("INFO", logger="mindspeed"):
        mindspeed.adapt(parse_args(ON + UNTIED + fb + ["--dualpipev-dw-detach", "--device", "cpu"], world_size=4))
        mindspeed.unadapt()
    lines = [r.getMessage() for r in caplog.records if "--dualpipev-dw-detach" in r.getMessage()]
    assert lines == ["MindSpeed: --dualpipev-dw-detach has no effect here: with --moe-fb-overlap Megatron-Core's "
                     "combined forward-backward step computes each backward's weight gradients within it"]


def test_megatron_lm_scripts_refuse_dualpipev_in_one_line():
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.megatron_lm import MegatronLMHooks
    state = mindspeed.adapt(["--device", "cpu"])
    try:
        hooks = MegatronLMHooks(state, msadapter=False)
        with pytest.raises(SystemExit, match=re.escape("MindSpeed: --schedules-method dualpipev: DualPipeV runs on "
                                                       "the built-in torch trainer")):
            hooks._after_megatron(parse_args(ON + UNTIED + ["--mock-data"], world_size=2))
    finally:
        mindspeed.unadapt()


def test_the_v_numbers_chunk_1_as_stage_2pp_minus_1_minus_r_and_unadapt_restores_it():
    """Megatron's own offset for virtual stage 1 of rank r is (PP + r) x layers per chunk; the V's is
    (2PP-1-r) x layers per chunk. The hook wraps Megatron's function; unadapt() puts it back."""
    import mindspeed
    from megatron.core.transformer import transformer_block, transformer_layer
    from mindspeed.training.model import transformer_config
    from mindspeed.flags.trainer_flags import parse_args
    original = transformer_layer.get_transformer_layer_offset
    args = parse_args(ON + UNTIED + ["--pipeline-model-parallel-size", "4", "--num-layers", "16",
                                     "--global-batch-size", "8"], world_size=4)
    mindspeed.adapt(args)
    try:
        config = transformer_config(args)
        offset = transformer_block.get_transformer_layer_offset
        assert offset is not original
        assert [offset(config, 0, r) for r in range(4)] == [0, 2, 4, 6]
        assert [offset(config, 1, r) for r in range(4)] == [14, 12, 10, 8]
        assert [original(config, 1, r) for r in range(4)] == [8, 10, 12, 14]
    finally:
        mindspeed.unadapt()
    assert transformer_block.get_transformer_layer_offset is original
