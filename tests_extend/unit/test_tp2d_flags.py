"""--tp-2d: upstream's limits and this implementation's refused in one line before any work, --tp-x/--tp-y
alone inert, the MindSpore refusal naming what its trainer lacks, and the grid's sub-groups.
(Training with it: tests_extend/distributed/test_tp2d.py.)"""
import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan
from mindspeed.features.parallel.tp2d_ops import grid_groups

ON = ["--tp-2d", "--tp-x", "2", "--tp-y", "2", "--tensor-model-parallel-size", "4"]


@pytest.mark.parametrize("argv, message", [
    (["--tp-2d", "--tp-x", "2", "--tp-y", "1", "--tensor-model-parallel-size", "4"],
     "needs --tp-x x --tp-y = --tensor-model-parallel-size: 2 x 1 != 4"),
    (ON + ["--sequence-parallel"], "cannot run with --sequence-parallel"),
    (ON + ["--num-experts", "4"], "cannot run with MoE"),
    (ON + ["--context-parallel-size", "2"], "cannot run with --context-parallel-size > 1"),
    (ON + ["--num-attention-heads", "6"], "--num-attention-heads 6 must divide by TP"),
    (ON + ["--use-fused-rmsnorm"], "fused-rmsnorm"),
    (ON + ["--use-ascend-coc"], "ascend-coc"),
    (ON + ["--backend", "mindspore"], "has no 2-D layers, and on CPU its collectives have no native "
                                      "ReduceScatter or sub-group AllGather"),
])
def test_what_tp_2d_cannot_run_is_refused_in_one_line(argv, message):
    with pytest.raises(MindSpeedConfigError) as err:
        plan(argv)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_grid_is_accepted_and_its_sizes_alone_are_inert():
    assert "tp-2d" in [f.id for f in plan(ON).features]
    alone = plan(["--tp-x", "2", "--tp-y", "2", "--tensor-model-parallel-size", "4"])
    assert [(f.id, why) for f, why, _ in alone.inert] == [
        ("tp-2d", "without --tp-2d the TP ranks form no grid: --tp-x/--tp-y have no effect")]


def test_mindspore_on_cpu_has_no_native_reduce_scatter_or_all_gather():
    """What the MindSpore row names: its CPU collectives emulate both through AllReduce (and its trainer
    has no 2-D layers: Megatron-Core, which the feature hooks into, is absent there)."""
    from mindspeed.backends.base import Cap, Level
    from mindspeed.backends.mindspore.capabilities import NOTES, declared
    caps = declared("cpu")
    assert caps[Cap.REDUCE_SCATTER] == caps[Cap.ALL_GATHER] == Level.EMULATED
    assert caps[Cap.MEGATRON_CORE] == Level.ABSENT
    assert "AllReduce" in NOTES["cpu"][Cap.REDUCE_SCATTER] and "AllReduce" in NOTES["cpu"][Cap.ALL_GATHER]


def test_grid_groups_x_then_y_over_each_tp_group():
    # TP rank r at (r % x, r // x): x groups share y_rank, y groups share x_rank
    assert grid_groups([[0, 1, 2, 3], [4, 5, 6, 7]], 2, 2) == [
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]]), ([[4, 5], [6, 7]], [[4, 6], [5, 7]])]
    assert grid_groups([[0, 1]], 1, 2) == [([[0], [1]], [[0, 1]])]
    with pytest.raises(ValueError):
        grid_groups([[0, 1, 2]], 2, 2)
