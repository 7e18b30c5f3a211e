"""--noop-layers and --num-layer-list: one-line refusals of bad values, what the list becomes in
Megatron's terms, and FLOP counts without the noop layers. Training with them:
tests_extend/distributed/test_pipeline_layers.py; under Megatron-LM: tests_extend/system/test_megatron_lm.py;
the MindSpore GPT's noop layers: test_mindspore_backend.py."""
import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan
from mindspeed.features.parallel.layers import host_split, layout_string
from mindspeed.features.parallel.pipeline_layout import layout_stages, matrix_layout, parse_matrix
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


MATRIX = "--pipeline-num-transformer-layers"
LAYOUT = "--pipeline-model-parallel-layout"


@pytest.mark.parametrize("argv, message", [
    ([MATRIX, "[[1,2]"], f"{MATRIX} takes one row of non-negative layer counts per pipeline stage"),
    ([MATRIX, "[[1,-1],[2,2]]"], f"{MATRIX} takes one row of non-negative layer counts per pipeline stage"),
    ([MATRIX, "[[1,1],[1,2]]"], f"{MATRIX} [[1,1],[1,2]] holds 5 transformer layers, not --num-layers 4"),
    ([MATRIX, "[[1,1,2]]"], f"{MATRIX} [[1,1,2]] has 1 pipeline stage(s) but --pipeline-model-parallel-size is 2"),
    ([MATRIX, "[[1,2],[1]]"], "every pipeline stage needs the same number of virtual stages (columns), got [2, 1]"),
    ([MATRIX, "[[0,2],[1,1]]", "--num-layers-per-virtual-pipeline-stage", "2"],
     "has 2 virtual stage(s) per pipeline stage but --num-layers-per-virtual-pipeline-stage 2 gives 1: leave it out"),
    ([MATRIX, "[[0,2],[1,1]]", "--num-layer-list", "2,2"], f"{MATRIX} [[0,2],[1,1]] sets each stage's layers: "
                                                             "leave out --num-layer-list"),
    ([MATRIX, "[[1],[3]]", "--decoder-last-pipeline-num-layers", "2"], "leave out --decoder-last-pipeline-num-layers"),
    ([MATRIX, "[[0,2],[1,1]]", LAYOUT, "E|tt|t|tL"], f"leave out {LAYOUT}"),
    ([LAYOUT, "E|t|t"], f"{LAYOUT} E|t|t has 3 stages, not a multiple of --pipeline-model-parallel-size 2"),
    ([LAYOUT, "Et|tx|tt|L"], f"{LAYOUT} takes stages separated by | made of E (embedding)"),
    ([LAYOUT, "tE|t|tt|L"], f"{LAYOUT} tE|t|tt|L needs the embedding E once, first"),
    ([LAYOUT, "Et|t|ttL|"], "needs the loss L once, last"),
    ([LAYOUT, "Et|t|t|tmL"], "needs 0 MTP layer(s) m (--mtp-num-layers)"),
    ([LAYOUT, "Et|tm|t|tL", "--mtp-num-layers", "1"], "the MTP layers after every transformer layer; the MTP "
                                                      "layers together in one last virtual stage"),
    ([LAYOUT, "E|tt|t|tL", "--num-layers-per-virtual-pipeline-stage", "1"],
     f"{LAYOUT} E|tt|t|tL sets the virtual stages: leave out --num-layers-per-virtual-pipeline-stage"),
])
def test_unaligned_pipeline_refusals_are_one_line(argv, message):
    with pytest.raises(MindSpeedConfigError) as err:
        plan(FOUR + PP2 + argv)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_pp1_matrix_with_one_stage_is_inert_and_virtual_stages_at_pp1_are_refused():
    p = plan(FOUR + [MATRIX, "[[4]]"])
    assert [f.id for f, *_ in p.inert] == ["unaligned-pipeline"] and not p.features
    with pytest.raises(MindSpeedConfigError, match="virtual stages need --pipeline-model-parallel-size >= 2"):
        plan(FOUR + [MATRIX, "[[2,2]]"])


def test_the_matrix_becomes_megatron_s_layout():
    assert parse_matrix("[[0,1],[1,1]*4,[1,0]]") == [[0, 1]] + [[1, 1]] * 4 + [[1, 0]]   # upstream's example
    assert parse_matrix(" [[1], [2]*2, [1]] ") == [[1], [2], [2], [1]]
    assert matrix_layout([[0, 2], [1, 1]]) == "E|t|tt|tL"           # virtual stage v of rank r: Megatron's 2v + r
    assert matrix_layout([[1, 1], [1, 1]], mtp_layers=1) == "Et|t|t|tmL"
    feature = next(f for f in plan(FOUR + PP2 + [MATRIX, "[[0,2],[1,1]]"]).features if f.id == "unaligned-pipeline")
    ns = plan(FOUR + PP2 + [MATRIX, "[[0,2],[1,1]]"]).args
    assert feature.host_values(ns) == {"pipeline_model_parallel_layout": "E|t|tt|tL",
                                       "num_layers_per_virtual_pipeline_stage": None}
    ns = plan(FOUR + PP2 + [MATRIX, "[[1],[3]]"]).args     # no virtual stage: Megatron's first/last stage flags
    assert feature.host_values(ns) == {"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3}
    ns = plan(["--num-layers", "8", "--pipeline-model-parallel-size", "4", MATRIX, "[[1],[2],[3],[2]]"]).args
    assert feature.host_values(ns) == {"pipeline_model_parallel_layout": "Et|tt|ttt|ttL",
                                       "num_layers_per_virtual_pipeline_stage": None}


@pytest.mark.parametrize("text", ["E|t|tt|tL", "Ettt|(tt|)*3,m|L", "E(t|)*2,t*3|L", "Et*2|t|m*2L"])
def test_layout_stages_read_as_megatron_core_reads_them(text):
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.enums import LayerType
    kinds = {"E": LayerType.embedding, "t": LayerType.decoder, "m": LayerType.mtp, "L": LayerType.loss}
    theirs = PipelineParallelLayerLayout.parse_str_to_list(text)
    assert [[kinds[c] for c in stage] for stage in layout_stages(text)] == theirs


def test_the_mindspore_gpt_holds_the_matrix_s_layers_per_chunk():
    """Megatron's order (virtual stage v of rank r is v x PP + r) on the MindSpore trainer; its interleaved
    schedule's micro-batch rule holds for the matrix's virtual stages too."""
    from mindspeed.training.mindspore.model import GPTConfig
    argv = FOUR + PP2 + [MATRIX, "[[0,2],[1,1]]", "--micro-batch-size", "1"]
    cfg = GPTConfig.from_args(parse_args(argv + ["--global-batch-size", "4"], world_size=2), 64)
    assert cfg.virtual_chunks == 2 and cfg.pipeline_layers == (2, 2)
    assert [[list(cfg.chunk_layers(r, c)) for c in (0, 1)] for r in (0, 1)] == [[[], [1, 2]], [[0], [3]]]
    for backend in ("mindspore", "torch"):     # Megatron-Core's schedule raises at the first step otherwise
        with pytest.raises(MindSpeedConfigError, match="3 micro-batches per step: the interleaved schedule"):
            plan(["--backend", backend] + argv + ["--global-batch-size", "3"])


def test_megatron_core_builds_the_matrix_s_stages():
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.enums import LayerType
    rows = [[0, 1], [1, 1], [2, 1]]
    layout = PipelineParallelLayerLayout.from_str(matrix_layout(rows), 3)
    layout.validate_layer_layout(num_layers=6, mtp_num_layers=None)
    assert [[stage.count(LayerType.decoder) for stage in row] for row in layout.layout] == rows   # [pp rank][vpp]
    assert layout.layout[0][0] == [LayerType.embedding] and layout.layout[2][1][-1] == LayerType.loss
