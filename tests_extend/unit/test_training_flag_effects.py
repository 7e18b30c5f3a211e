"""What the Megatron flags the trainer accepts change: model config, optimizer config, process
group backend, batch size ramp-up, tokenizers and the iteration log line (no training run)."""
import importlib.util
import re

import pytest
import torch

from mindspeed.data.tokenizer import TokenizerError
from mindspeed.training import flops, model
from mindspeed.flags.trainer_flags import parse_args
from mindspeed.training.logger import StepRecorder, TrainingLogger


def _args(*argv, world_size=1):
    return parse_args(list(argv), world_size=world_size)


# --- TransformerConfig ----------------------------------------------------------------------------

def test_softmax_flags_reach_the_transformer_config():
    default = model.transformer_config(_args())
    assert default.masked_softmax_fusion is False          # cpu: Megatron's CUDA softmax is not there
    assert default.attention_softmax_in_fp32 is False and default.transformer_impl == "local"
    config = model.transformer_config(_args("--attention-softmax-in-fp32", "--apply-query-key-layer-scaling"))
    assert config.attention_softmax_in_fp32 is True and config.apply_query_key_layer_scaling is True


def test_masked_softmax_fusion_is_on_where_the_kernel_is_installed_unless_refused(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(model.importlib.util, "find_spec",
                        lambda name, *a: object() if name in model.SOFTMAX_EXTENSIONS else real_find_spec(name, *a))
    on_cuda = _args()
    on_cuda.device_name = "cuda"
    assert model.transformer_config(on_cuda).masked_softmax_fusion is True
    refused = _args("--no-masked-softmax-fusion")
    refused.device_name = "cuda"
    assert model.transformer_config(refused).masked_softmax_fusion is False
    on_cpu = _args()
    on_cpu.device_name = "cpu"
    assert model.transformer_config(on_cpu).masked_softmax_fusion is False


# --- OptimizerConfig ------------------------------------------------------------------------------

def test_fp16_loss_scaling_flags_reach_the_optimizer_config():
    from mindspeed.training.pretrain import optimizer_config
    config = optimizer_config(_args("--fp16", "--initial-loss-scale", "4096.0", "--min-loss-scale", "2",
                                    "--loss-scale-window", "50", "--hysteresis", "3"), torch.float16)
    assert (config.fp16, config.initial_loss_scale, config.min_loss_scale) == (True, 4096.0, 2.0)
    assert (config.loss_scale_window, config.hysteresis, config.loss_scale) == (50.0, 3, None)
    default = optimizer_config(_args("--fp16"), torch.float16)
    assert (default.initial_loss_scale, default.min_loss_scale, default.hysteresis) == (2.0 ** 32, 1.0, 2)
    assert optimizer_config(_args("--fp16", "--loss-scale", "128"), torch.float16).loss_scale == 128.0


# --- process group backend ------------------------------------------------------------------------

@pytest.mark.parametrize("requested, device, expected", [
    ("nccl", "cpu", "gloo"), ("nccl", "cuda", "nccl"), ("nccl", "npu", "hccl"), ("hccl", "cpu", "gloo"),
    (None, "npu", "hccl"), ("gloo", "cuda", "gloo"),
])
def test_distributed_backend_nccl_means_the_devices_collective_library(requested, device, expected):
    from mindspeed.training.pretrain import process_group_backend
    assert process_group_backend(requested, device) == expected


# --- --rampup-batch-size --------------------------------------------------------------------------

def test_rampup_batch_size_drives_the_step_batch():
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from mindspeed.training.pretrain import init_batch_schedule, step_batch
    args = _args("--micro-batch-size", "2", "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "24",
                 world_size=2)
    init_batch_schedule(args, rank=1)
    try:   # dp 2 x mbs 2 = 4 samples per micro-batch round; 3 increments, one per 8 samples
        assert [step_batch(c) for c in (0, 7, 8, 16, 25)] == [(1, 4), (1, 4), (2, 8), (3, 12), (4, 16)]
    finally:
        destroy_num_microbatches_calculator()
    init_batch_schedule(_args("--micro-batch-size", "2", "--global-batch-size", "16", world_size=2), rank=1)
    try:
        assert step_batch(0) == (4, 16)
    finally:
        destroy_num_microbatches_calculator()


# --- tokenizers -----------------------------------------------------------------------------------

def _gpt2_files(tmp_path, vocab='{"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}', merges="#version: 0.2\na b\n"):
    (tmp_path / "vocab.json").write_text(vocab)
    (tmp_path / "merges.txt").write_text(merges)
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")


def test_gpt2_bpe_and_null_tokenizers_report_megatrons_sizes(tmp_path):
    from mindspeed.data.flag_tokenizers import from_flags
    vocab, merges = _gpt2_files(tmp_path)
    gpt2 = from_flags(_args("--vocab-file", vocab, "--merge-file", merges, "--mock-data"))
    assert (gpt2.vocab_size, gpt2.eod) == (4, 3)
    null = from_flags(_args("--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--mock-data"))
    assert (null.vocab_size, null.eod) == (101, 100)       # Megatron: N ids plus end-of-document
    assert from_flags(_args()) is None                     # the dataset's saved tokenizer


@pytest.mark.parametrize("vocab, merges, message", [
    ('{"a": 0}', "a b\n", "no <|endoftext|> entry"),
    ("not json", "a b\n", "not a readable GPT-2 vocab.json"),
    ('{"<|endoftext|>": 0}', "#version: 0.2\n", "is not a GPT-2 merges.txt (empty)"),
    ('{"<|endoftext|>": 0}', "a b c\n", "is not a GPT-2 merges.txt (line 'a b c')"),
])
def test_bad_gpt2_vocabulary_files_are_reported(tmp_path, vocab, merges, message):
    from mindspeed.data.flag_tokenizers import GPT2VocabTokenizer
    with pytest.raises(TokenizerError, match=re.escape(message)):
        GPT2VocabTokenizer(*_gpt2_files(tmp_path, vocab, merges))


def test_gpt2_tokenizer_is_checked_against_the_dataset(tmp_path):
    from mindspeed.data.errors import DataError
    from mindspeed.data.preprocess import PreprocessConfig, preprocess
    from mindspeed.training.pretrain import resolve_tokenizer
    text = tmp_path / "a.txt"
    text.write_text("abba baab " * 50)
    prefix = str(tmp_path / "corpus")
    preprocess(PreprocessConfig(inputs=[str(text)], output_prefix=prefix), log=lambda m: None)
    vocab, merges = _gpt2_files(tmp_path, vocab='{"a": 0, "b": 1, "ab": 2, "ba": 3, " ": 4, "<|endoftext|>": 5}')
    args = _args("--vocab-file", vocab, "--merge-file", merges, "--data-path", prefix)
    with pytest.raises(TokenizerError, match="was tokenized with CharLevel"):
        resolve_tokenizer(args, log=lambda m: None)
    (tmp_path / "corpus.tokenizer.json").unlink()          # as Megatron's preprocess_data.py leaves it
    assert resolve_tokenizer(args, log=lambda m: None).vocab_size == 6     # the dataset's ids 0, 2..4 fit
    (tmp_path / "small").mkdir()
    small, _ = _gpt2_files(tmp_path / "small")
    with pytest.raises(DataError):                         # ids >= 4 do not fit a 4-entry vocabulary
        resolve_tokenizer(_args("--vocab-file", small, "--merge-file", merges, "--data-path", prefix),
                          log=lambda m: None)


# --- the iteration log line -----------------------------------------------------------------------

class _Lines(TrainingLogger):
    def __init__(self, args):
        super().__init__(args, is_writer=True)
        self.lines = []

    def print(self, msg):
        self.lines.append(msg)


def _log_one_step(args, elapsed=0.5, **record):
    logger = _Lines(args)
    steps = StepRecorder(logger, args, tokens_per_step=args.global_batch_size * args.seq_length, stop_at=1,
                         write_loss_file=False)
    steps.record(1, 2.0, elapsed, consumed=args.global_batch_size, lr=lambda: 1e-3, grad_norm=1.0,
                 peak_mem_mb=lambda: 0.0, **record)
    return logger.lines[-1]


def _gelu_model(*extra):
    args = _args("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                 "--no-swiglu", "--ffn-hidden-size", "256", "--micro-batch-size", "2", "--global-batch-size", "8",
                 "--log-interval", "1", *extra, world_size=2)
    args.padded_vocab_size = 128
    return args


def test_model_flops_are_counted_as_megatron_counts_them():
    # per token and layer: QKV 64x192 + proj 64x64 + causal scores/values 64x32 = 18432 MACs;
    # GELU MLP 2 x 64x256 = 32768; logits 64x128 = 8192; x2 FLOPs per MAC x3 passes
    assert flops.flops_per_token(_gelu_model()) == 6 * (2 * (18432 + 32768) + 8192)
    swiglu = _gelu_model("--swiglu")
    assert flops.flops_per_token(swiglu) == 6 * (2 * (18432 + 3 * 64 * 256) + 8192)
    gqa = _gelu_model("--group-query-attention", "--num-query-groups", "2")    # K and V at half width
    assert flops.flops_per_token(gqa) == 6 * (2 * (64 * 128 + 64 * 64 + 64 * 32 + 32768) + 8192)
    assert flops.flops_per_iteration(_gelu_model(), 8) == 8 * 32 * flops.flops_per_token(_gelu_model())


def test_log_throughput_puts_tflops_per_device_in_the_iteration_line():
    args = _gelu_model("--log-throughput")
    line = _log_one_step(args, elapsed=0.5)
    expected = flops.flops_per_token(args) * 8 * 32 / (0.5 * 1e12 * 2)       # 2 devices
    value = float(re.search(r"throughput per device \(TFLOP/s/device\): ([0-9.e+-]+) \|", line).group(1))
    assert value == pytest.approx(expected, rel=1e-3)
    assert "TFLOP/s" not in _log_one_step(_gelu_model())


def test_ramped_batch_and_fp16_loss_scale_appear_in_the_iteration_line():
    line = _log_one_step(_gelu_model(), elapsed=1.0, batch_size=4, loss_scale=lambda: 4096.0)
    assert "global batch size:     4 |" in line and "tokens per second: 128 |" in line    # 4 x 32 tokens
    assert "loss scale: 4096.0 |" in line
    assert "loss scale" not in _log_one_step(_gelu_model())


# --- the MindSpore trainer ------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--swap-optimizer"], "MindSpore 2.10 cannot release a Parameter's memory and bring it back on CPU"),
])
def test_mindspore_trainer_refuses_what_its_loop_cannot_do(argv, message):
    """The support matrix (the one gate) refuses these for the MindSpore trainer, not for torch."""
    from mindspeed.adaptor_core import MindSpeedConfigError, plan
    with pytest.raises(MindSpeedConfigError, match=re.escape(message)):
        plan(_args("--backend", "mindspore", *argv))
    plan(_args("--backend", "torch", *argv))
    plan(_args("--backend", "mindspore", "--distributed-backend", "nccl", "--log-throughput"))
