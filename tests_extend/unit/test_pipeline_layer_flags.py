"""--noop-layers and --num-layer-list: one-line refusals of bad values, what the list becomes in
Megatron's terms, and FLOP counts without the noop layers. Training with them:
tests_extend/distributed/test_pipeline_layers.py; under Megatron-LM: tests_extend/system/test_megatron_lm.py;
the MindSpore GPT's noop layers: test_mindspore_backend.py."""
import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan
from mindspeed.features.parallel.layers import host_split, layout_string
from mindspeed.training import flops
from mindspeed.flags.trainer_flags import parse_args

FOUR = ["--num-layers", "4"]
PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("argv, message", [
    (FOUR + ["--noop-layers", "0,4"], "--noop-layers 0,4: each index must be below --num-layers 4 (0-based)"),
    (FOUR + ["--noop-layers", "-1"], "--noop-layers takes comma-separated non-negative integers, got '-1'"),
    (FOUR + ["--noop-layers", "1,1"], "--noop-layers 1,1 names a layer twice"),
    (FOUR + PP2 + ["--num-layer-list", "1,2"], "--num-layer-list 1,2 sums to 3, not --num-layers 4"),
    (FOUR + PP2 + ["--num-layer-list", "1,1,2"],
     "--num-layer-list 1,1,2 has 3 entries but --pipeline-model-parallel-size is 2: give one per stage"),
    (FOUR + PP2 + ["--num-layer-list", "0,4"], "--num-layer-list 0,4: every stage needs at least one layer"),
    (FOUR + PP2 + ["--num-layer-list", "1,x"], "--num-layer-list takes comma-separated non-negative integers"),
    (FOUR + PP2 + ["--num-layer-list", "1,3", "--decoder-first-pipeline-num-layers", "2"],
     "--num-layer-list sets each stage's layers: leave out --decoder-first-pipeline-num-layers"),
])
def test_bad_values_are_refused_in_one_line(argv, message):
    with pytest.raises(MindSpeedConfigError) as err:
        plan(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_mindspore_splits_the_layers_as_megatron_and_refuses_what_its_pipeline_cannot_run():
    untied = ["--untie-embeddings-and-output-weights"]
    on = plan(["--backend", "mindspore"] + FOUR + PP2 + untied + ["--num-layer-list", "1,3"]).features
    assert {f.id for f in on} == {"pipeline-parallel", "uneven-pipeline-layers"}
    from mindspeed.training.mindspore.model import GPTConfig
    for extra, counts in ((["--num-layer-list", "1,3"], (1, 3)), (["--decoder-first-pipeline-num-layers", "1"], (1, 3)),
                          (["--decoder-last-pipeline-num-layers", "1"], (3, 1)), ([], (2, 2))):
        cfg = GPTConfig.from_args(parse_args(FOUR + PP2 + untied + extra, world_size=2), 64)
        assert cfg.pipeline_layers == counts, extra
        assert [list(cfg.stage_layers(r)) for r in (0, 1)] == [list(range(counts[0])), list(range(counts[0], 4))]
    assert {f.id for f in plan(["--backend", "mindspore"] + FOUR + PP2).features} == {"pipeline-parallel"}  # tied
    vpp = PP2 + untied + ["--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "1"]
    for argv, line in ((["--pipeline-model-parallel-size", "4"] + untied, "runs 2 stages"),
                       (vpp + ["--global-batch-size", "3"], "3 micro-batches per step: the interleaved schedule"),
                       (vpp + ["--global-batch-size", "8", "--rampup-batch-size", "2", "1", "8"],
                        "3 micro-batches per step")):
        with pytest.raises(MindSpeedConfigError, match=line) as err:
            plan(["--backend", "mindspore"] + FOUR + argv)
        assert "\n" not in str(err.value)
    # the interleaved schedule: Megatron-Core's layout, chunk c of stage r is virtual stage 2c + r
    assert {f.id for f in plan(["--backend", "mindspore"] + FOUR + vpp + ["--global-batch-size", "4"]).features} \
        == {"pipeline-parallel"}
    cfg = GPTConfig.from_args(parse_args(FOUR + vpp + ["--global-batch-size", "4"], world_size=2), 64)
    assert cfg.virtual_chunks == 2 and [cfg.stage_layers(r) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert [f.id for f in plan(["--backend", "mindspore", "--noop-layers", "1"] + FOUR).features] == ["noop-layers"]


def test_the_trainer_accepts_a_list_that_megatron_s_even_split_would_refuse():
    args = parse_args(["--num-layers", "5"] + PP2 + ["--num-layer-list", "2,3"], world_size=2)
    assert args.num_layer_list == "2,3"
    with pytest.raises(Exception, match="not divisible"):
        parse_args(["--num-layers", "5"] + PP2, world_size=2)


def test_the_list_becomes_megatron_s_uneven_stages_or_its_layout():
    assert host_split([2, 2]) == {} and host_split([4]) == {}
    assert host_split([1, 3]) == {"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3}
    assert host_split([1, 2, 2, 3]) == {"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3}
    assert host_split([1, 2, 3, 2]) == {"pipeline_model_parallel_layout": "Et|tt|ttt|ttL"}


def test_megatron_core_reads_the_layout_as_the_list():
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.enums import LayerType
    layout = PipelineParallelLayerLayout.from_str(layout_string([1, 2, 3, 2]), 4)
    assert [layout.get_num_layers_to_build(LayerType.decoder, pp_rank=r) for r in range(4)] == [1, 2, 3, 2]
    assert [layout.get_layer_offset(LayerType.decoder, pp_rank=r) for r in range(4)] == [0, 1, 3, 6]
    layout.validate_layer_layout(num_layers=8, mtp_num_layers=None)     # embedding first, loss last


def test_flops_leave_the_noop_layers_out():
    def per_token(*extra, layers="4"):
        args = parse_args(["--num-layers", layers, "--hidden-size", "64", "--num-attention-heads", "4",
                           "--seq-length", "32", *extra])
        args.padded_vocab_size = 128
        return flops.flops_per_token(args)
    assert per_token("--noop-layers", "0,3") == per_token(layers="2") < per_token()
