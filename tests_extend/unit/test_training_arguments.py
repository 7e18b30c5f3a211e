"""The Megatron-style command line: derived values and the errors raised before any work."""
import pytest

from mindspeed.errors import ArgumentError
from mindspeed.flags.trainer_flags import build_parser, parse_args


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


# --- Megatron-LM's GPT pretraining flags ----------------------------------------------------------

@pytest.fixture
def gpt2_files(tmp_path):
    vocab, merges = tmp_path / "gpt2-vocab.json", tmp_path / "gpt2-merges.txt"
    vocab.write_text('{"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}')
    merges.write_text("#version: 0.2\na b\n")
    return str(vocab), str(merges)


def gpt3_script_argv(tmp_path, vocab, merges):
    """Every flag of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (the same in
    core_v0.12.1 and core_v0.16.1), in its order, with small values; world size 4."""
    ckpt = str(tmp_path / "ckpt")
    return [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "64",
        "--train-iters", "50", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
        "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".1", "--lr-decay-iters", "40",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--data-path", str(tmp_path / "corpus_text_document"), "--vocab-file", vocab, "--merge-file", merges,
        "--split", "949,50,1",
        "--log-interval", "10", "--save-interval", "20", "--eval-interval", "10", "--save", ckpt, "--load", ckpt,
        "--eval-iters", "2", "--tensorboard-dir", str(tmp_path / "tb"),
    ]


MINDSPEED_EXAMPLE_FLAGS = ["--no-masked-softmax-fusion", "--attention-softmax-in-fp32",
                           "--initial-loss-scale", "4096.0", "--log-throughput"]


def test_megatron_gpt3_example_flags_all_parse(tmp_path, gpt2_files):
    args = parse_args(gpt3_script_argv(tmp_path, *gpt2_files) + MINDSPEED_EXAMPLE_FLAGS, world_size=4)
    assert args.data_parallel_size == 1 and args.rampup_batch_size == [4, 4, 64]
    assert args.fp16 and args.params_dtype == "fp16" and args.lr_warmup_iters == 4   # .1 x 40
    assert args.tokenizer_type == "GPT2BPETokenizer"        # implied by --vocab-file + --merge-file
    assert args.attention_backend == "auto" and not args.use_flash_attn
    assert args.masked_softmax_fusion is False and args.attention_softmax_in_fp32 is True
    assert args.initial_loss_scale == 4096.0 and args.log_throughput is True
    # --save X --load X before X holds a checkpoint: Megatron's auto-resume idiom starts fresh
    assert args.load is None and "no checkpoint yet" in args.load_note


def test_mindspeed_upstream_example_flags_all_parse(tmp_path, gpt2_files):
    """The flags of MindSpeed's tests_extend/example/train_distributed.sh upstream, small values."""
    vocab, merges = gpt2_files
    argv = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--num-layers-per-virtual-pipeline-stage", "1", "--num-layers", "4", "--hidden-size", "64",
            "--ffn-hidden-size", "224", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "16",
            "--make-vocab-size-divisible-by", "1", "--lr", "1.0e-6", "--train-iters", "100",
            "--init-method-std", "0.01", *MINDSPEED_EXAMPLE_FLAGS[:2], "--min-lr", "1.0e-7",
            "--weight-decay", "0.1", "--clip-grad", "1.0", *MINDSPEED_EXAMPLE_FLAGS[2:4], "--disable-bias-linear",
            "--lr-warmup-fraction", "0.01", "--fp16", "--split", "990,5,5",
            "--data-path", str(tmp_path / "corpus_text_document"), "--vocab-file", vocab, "--merge-file", merges,
            MINDSPEED_EXAMPLE_FLAGS[4], "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "10000",
            "--eval-iters", "10", "--distributed-backend", "nccl"]
    args = parse_args(argv, world_size=4)
    assert args.lr_warmup_iters == 1 and args.tokenizer_type == "GPT2BPETokenizer"
    assert args.distributed_backend == "nccl" and args.initial_loss_scale == 4096.0


def test_megatron_defaults_of_the_new_flags():
    args = parse_args([], world_size=1)
    assert args.masked_softmax_fusion and args.bias_gelu_fusion and args.bias_swiglu_fusion
    assert args.bias_dropout_fusion and args.apply_rope_fusion and not args.attention_softmax_in_fp32
    assert args.transformer_impl == "local" and args.attention_backend == "auto"
    assert args.rampup_batch_size is None and not args.log_throughput and args.initial_loss_scale is None


def test_save_and_load_the_same_directory_resumes_once_a_checkpoint_is_there(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    args = parse_args(["--save", str(ckpt), "--load", str(ckpt)], world_size=1)
    assert args.load == str(ckpt) and args.load_note is None
    with pytest.raises(ArgumentError, match="--load path"):          # a --load elsewhere must exist
        parse_args(["--save", str(ckpt), "--load", str(tmp_path / "typo")], world_size=1)


@pytest.mark.parametrize("backend", ["auto", "local", "unfused", "flash"])
def test_attention_backends_map_to_what_exists(backend):
    args = parse_args(["--attention-backend", backend], world_size=1)
    assert args.use_flash_attn is (backend == "flash")      # flash = MindSpeed's flash-attention kernel
    from mindspeed.features.registry import enabled_features
    assert ("flash-attn" in [f.id for f in enabled_features(args)]) is (backend == "flash")


@pytest.mark.parametrize("flag", ["--use-mcore-models", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                                  "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
                                  "--accumulate-allreduce-grads-in-fp32", "--apply-query-key-layer-scaling",
                                  "--no-bias-swiglu-fusion", "--no-rope-fusion"])
def test_megatron_switches_that_state_what_the_trainer_does_are_accepted(flag):
    parse_args([flag], world_size=1)


def test_no_gradient_accumulation_fusion_turns_off_mindspeeds_feature_flag():
    assert parse_args(["--gradient-accumulation-fusion"], world_size=1).gradient_accumulation_fusion
    args = parse_args(["--gradient-accumulation-fusion", "--no-gradient-accumulation-fusion"], world_size=1)
    assert args.gradient_accumulation_fusion is False


@pytest.mark.parametrize("argv, message", [
    (["--transformer-impl", "transformer_engine"],
     "--transformer-impl transformer_engine needs NVIDIA Transformer Engine, which MindSpeed does not use: "
     "use --transformer-impl local"),
    (["--use-legacy-models"], "--use-legacy-models: the built-in trainer builds Megatron-Core's GPTModel only"),
    (["--attention-backend", "fused"], "--attention-backend fused needs Transformer Engine's cuDNN fused attention"
                                       ", which MindSpeed does not use: use --attention-backend flash"),
    (["--attention-backend", "unfused", "--use-flash-attn"],
     "--attention-backend unfused (Megatron-Core's unfused attention) contradicts --use-flash-attn"),
    (["--no-bias-swiglu-fusion", "--use-fused-swiglu"], "--no-bias-swiglu-fusion contradicts --use-fused-swiglu"),
    (["--no-rope-fusion", "--use-fused-rotary-pos-emb"], "--no-rope-fusion contradicts --use-fused-rotary-pos-emb"),
    (["--fp16", "--loss-scale", "128", "--min-loss-scale", "2"],
     "--loss-scale sets a static scale, so --min-loss-scale (dynamic scaling) would be unused"),
    (["--fp16", "--initial-loss-scale", "0"], "--initial-loss-scale must be positive"),
    (["--global-batch-size", "16", "--micro-batch-size", "2", "--rampup-batch-size", "16", "4", "100"],
     "--rampup-batch-size start 16 must be below --global-batch-size 16"),
    (["--global-batch-size", "16", "--micro-batch-size", "2", "--rampup-batch-size", "4", "8", "100"],
     "reach it in steps of 8"),
    (["--global-batch-size", "16", "--micro-batch-size", "2", "--rampup-batch-size", "3", "1", "100"],
     "must be multiples of micro-batch-size x data-parallel size = 2"),
    (["--rampup-batch-size", "0", "4", "100"], "start and increment must be positive"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], "give only one"),
    (["--lr-wsd-decay-iters", "5"], "--lr-wsd-decay-iters: only a WSD schedule reads it (add --lr-decay-style WSD"),
    (["--lr-decay-style", "cosine", "--lr-wsd-decay-style", "linear"], "--lr-wsd-decay-style: only a WSD schedule reads it"),
    (["--ckpt-format", "torch", "--backend", "mindspore"],
     "--ckpt-format torch (Megatron-LM's per-rank files) is written by --backend torch"),
    (["--tokenizer-type", "SentencePieceTokenizer"],
     "--tokenizer-type SentencePieceTokenizer is not available in the built-in trainer: use GPT2BPETokenizer"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", __file__, "--data-path", "x"],
     "--tokenizer-type GPT2BPETokenizer needs --vocab-file"),
    (["--vocab-file", "v.json"], "--vocab-file/--merge-file are read only by --tokenizer-type GPT2BPETokenizer"),
    (["--vocab-file", "/nonexistent/v.json", "--merge-file", __file__, "--data-path", "x"],
     "--vocab-file '/nonexistent/v.json' does not exist"),
    (["--tokenizer-type", "NullTokenizer", "--data-path", "x"], "NullTokenizer needs --vocab-size"),
    (["--moe-router-topk", "4"], "--moe-router-topk configure MoE layers: add --num-experts"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"], "NullTokenizer needs --data-path (or --mock-data)"),
])
def test_megatron_flags_that_cannot_be_honoured_are_refused_in_one_line(argv, message):
    with pytest.raises(ArgumentError) as err:
        parse_args(argv, world_size=1)
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_the_whole_gpt3_script_with_transformer_engine_is_refused_before_any_work(tmp_path, gpt2_files):
    argv = gpt3_script_argv(tmp_path, *gpt2_files) + ["--transformer-impl", "transformer_engine"]
    with pytest.raises(ArgumentError, match="--transformer-impl transformer_engine needs"):
        parse_args(argv, world_size=4)


def test_uneven_first_and_last_pipeline_stages():
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.errors import ArgumentError
    base = ["--num-layers", "4", "--pipeline-model-parallel-size", "2"]
    args = parse_args(base + ["--decoder-first-pipeline-num-layers", "1"], world_size=2)
    assert args.decoder_first_pipeline_num_layers == 1
    parse_args(["--num-layers", "6", "--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers",
                "1", "--decoder-last-pipeline-num-layers", "1"], world_size=4)
    with pytest.raises(ArgumentError, match="does not split evenly"):
        parse_args(base + ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "2"],
                   world_size=2)
    with pytest.raises(ArgumentError, match="not divisible"):
        parse_args(["--num-layers", "3", "--pipeline-model-parallel-size", "2"], world_size=2)
