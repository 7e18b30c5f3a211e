"""The Megatron-style command line: derived values and the errors raised before any work."""
import pytest

from mindspeed.training.arguments import ArgumentError, build_parser, parse_args


def test_defaults_and_derived_values():
    args = parse_args(["--hidden-size", "128", "--micro-batch-size", "4"], world_size=2)
    assert args.data_parallel_size == 2 and args.global_batch_size == 8
    assert args.ffn_hidden_size % 64 == 0 and args.kv_channels == 128 // args.num_attention_heads
    assert args.backend == "torch" and args.optimization_level == 2


def test_mindspeed_flags_are_added_and_ai_framework_is_an_alias():
    args = parse_args(["--ai-framework", "mindspore"], world_size=1)
    assert args.backend == "mindspore"
    with pytest.raises(ArgumentError, match="disagree"):
        parse_args(["--ai-framework", "mindspore", "--backend", "torch"], world_size=1)


def test_build_parser_reads_no_argv():
    assert build_parser().parse_args([]).num_layers > 0


@pytest.mark.parametrize("argv, world, message", [
    (["--tensor-model-parallel-size", "3"], 2, "world size 2 is not divisible"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "3"], 2, "--num-layers 3 is not divisible"),
    (["--tensor-model-parallel-size", "2", "--num-attention-heads", "3", "--hidden-size", "96"], 2,
     "--num-attention-heads 3 is not divisible"),
    (["--hidden-size", "100", "--num-attention-heads", "3"], 1, "--hidden-size 100 is not divisible"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 2, "--global-batch-size 6"),
    (["--load", "/nonexistent/ckpt"], 1, "--load path"),
    (["--lr-warmup-iters", "50", "--train-iters", "50"], 1, "--lr-warmup-iters 50"),
    (["--num-layers", "0"], 1, "--num-layers must be a positive integer"),
])
def test_bad_combinations_are_refused_with_a_clear_message(argv, world, message):
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(")):
        parse_args(argv, world_size=world)
