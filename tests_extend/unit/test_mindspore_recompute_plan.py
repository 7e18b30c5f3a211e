"""Megatron-Core's recompute methods as layer chunks for the MindSpore GPT (recompute_plan.py);
the parity test (test_mindspore_parity_model.py) checks that the chunks rerun in backward."""
from mindspeed.training.mindspore.recompute_plan import layer_chunks


def test_uniform_groups_of_n_layers_each_one_chunk():
    assert layer_chunks([0, 1, 2, 3, 4], "uniform", 2) == [([0, 1], True), ([2, 3], True), ([4], True)]
    assert layer_chunks([0, 1], "uniform", 1) == [([0], True), ([1], True)]


def test_block_recomputes_the_first_n_layers_alone():
    assert layer_chunks([4, 5, 6], "block", 2) == [([4], True), ([5], True), ([6], False)]   # a later stage's
    assert layer_chunks([0, 1], "block", 0) == [([0], False), ([1], False)]


def test_no_method_recomputes_nothing_and_noop_layers_are_not_counted():
    assert layer_chunks([0, 1], None, 2) == [([0], False), ([1], False)]
    assert layer_chunks([0, 2, 3], "uniform", 2) == [([0, 2], True), ([3], True)]     # layer 1 is a noop
