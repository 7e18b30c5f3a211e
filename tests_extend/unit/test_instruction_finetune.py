"""Fine-tuning as the LLM guide does it: a tiny Hugging Face Llama (built here) converted to a
Megatron checkpoint, an Alpaca JSONL preprocessed with its tokenizer, then `--finetune --load MG
--is-instruction-dataset` on the built-in trainers. Prompt tokens must carry no loss: changing
their labels leaves the loss as it is, changing a reply token's label does not."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re

import numpy as np
import pytest
import torch

from tests_extend.system.one_process_run import run_pretrain_gpt
from tests_extend.unit import convert_kit, data_kit

pytest.importorskip("transformers")
RUN = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--split", "80,20,0",
       "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--seed", "5"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    tok, hf, mg = str(root / "tok"), str(root / "hf"), str(root / "mg")
    data_kit.make_tokenizer(tok)
    convert_kit.make_hf_model(hf, "llama", tied=False, num_hidden_layers=2)
    convert_kit.convert("--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "llama2",
                        "--load-dir", hf, "--save-dir", mg, "--tokenizer-model", os.path.join(tok, "tokenizer.json"),
                        "--neutral-copy")
    prefix = str(root / "data" / "alpaca")
    assert data_kit.preprocess("--input", data_kit.write_jsonl(root / "alpaca.jsonl", data_kit.ALPACA * 4),
                               "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tok,
                               "--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "llama2",
                               "--output-prefix", prefix) == 0
    from mindspeed.convert.sidecar import read_info
    flags = read_info(mg)["trainer_flags"] + ["--load", mg, "--finetune", "--data-path", prefix,
                                              "--is-instruction-dataset", *RUN]
    return {"root": root, "tok": tok, "flags": flags}


def _replies(tok_dir: str) -> list[list[int]]:
    from mindspeed.data.tokenizer import HuggingFaceTokenizer
    tok = HuggingFaceTokenizer(tok_dir)
    return [tok.encode(r["output"]) + [tok.eos_id] for r in data_kit.ALPACA]


@contextlib.contextmanager
def trainer_session(flags):
    """The loaded checkpoint in the torch trainer (one process): (args, tokenizer, loss_of) where
    `loss_of(batch)` runs the trainer's forward step -> (loss sum, kept-token count)."""
    from mindspeed.convert.megatron_write import adapted, world_of_one
    from mindspeed.training import data, pretrain
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.flags.trainer_flags import padded_vocab_size
    args = parse_args(flags + ["--backend", "torch", "--device", "cpu"], world_size=1)
    with adapted(args) as session, world_of_one():
        tokenizer = data.resolve_data(args, log=lambda m: None)
        args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, 1)
        model = convert_kit.load_trainer_model(args)

        def loss_of(batch, eod="trainer's"):
            with torch.no_grad():
                if eod == "trainer's":
                    eod = tokenizer.eod if session.packed_documents(args) else None
                output, loss_func = pretrain.forward_step(data.BatchReader("cpu", eod), iter([batch]), model)
                return loss_func(output)[1]["lm loss"]
        def datasets(a):      # the trainer's: no dense mask where the session's batches carry documents
            return data.build_datasets(a, tokenizer, packed=session.packed_documents(a))
        yield args, tokenizer, loss_of, datasets


@contextlib.contextmanager
def torch_trainer(flags):
    """The trainer's own data path and forward step on the loaded checkpoint (one process): the
    first global batch's micro-batches and `loss_of(batch)` -> (loss sum, kept-token count)."""
    from mindspeed.training import data
    with trainer_session(flags) as (args, _tokenizer, loss_of, datasets):
        train, _valid, _ = datasets(args)
        batches = data.microbatches(train, 0, args)
        micro = [next(batches) for _ in range(args.global_batch_size // args.micro_batch_size)]
        yield micro, loss_of


def first_step(flags) -> tuple[list, list]:
    """The first global batch's micro-batches and their (loss sum, kept-token count) pairs."""
    with torch_trainer(flags) as (micro, loss_of):
        return micro, [loss_of(b) for b in micro]


def test_prompt_tokens_carry_no_loss_and_reply_tokens_do(setup):
    replies = _replies(setup["tok"])
    with torch_trainer(setup["flags"]) as (micro, loss_of):
        batch = micro[0]
        for row in range(batch["tokens"].shape[0]):     # the kept labels are exactly one record's reply
            kept = batch["labels"][row][batch["loss_mask"][row] > 0].tolist()
            assert kept in replies, kept
        mask = batch["loss_mask"][0]
        first = int(torch.nonzero(mask)[0])             # the position that predicts the first reply token
        assert first > 0 and mask[:first].sum() == 0
        pair = loss_of(batch)
        base = pair[0] / pair[1]

        def with_label(position):
            changed = {k: v.clone() for k, v in batch.items()}
            changed["labels"][0, position] = (int(batch["labels"][0, position]) + 7) % 100
            pair = loss_of(changed)
            return pair[0] / pair[1]
        for position in (0, first - 1):                 # prompt positions: the loss does not move
            assert torch.equal(with_label(position), base)
        assert abs(float(with_label(first) - base)) > 1e-4


def test_neat_packed_samples_have_the_losses_of_the_samples_alone(setup):
    """--pack --neat-pack stores each bin's sample numbers; trained with --neat-pack the loss of
    every bin is the sum of its samples' losses run one by one (attention and positions stay
    inside each sample), and a dataset/flag mismatch is refused in one line. With flash attention
    the samples reach the kernel as per-sample lengths (TND): no [s, s] mask is built."""
    from mindspeed.backends import get_backend
    from mindspeed.data.errors import DataError
    from mindspeed.training import data
    from mindspeed.data import instruction_samples as instruction_data
    from mindspeed.data.indexed_reader import IndexedTokens
    root, neat = setup["root"], str(setup["root"] / "data" / "neat")
    args = ["--input", str(root / "alpaca.jsonl"), "--tokenizer-type", "PretrainedFromHF",
            "--tokenizer-name-or-path", setup["tok"], "--handler-name", "AlpacaStyleInstructionHandler",
            "--prompt-type", "llama2", "--output-prefix", neat, "--seq-length", "32"]
    assert data_kit.preprocess(*args, "--neat-pack") == 2              # --neat-pack needs --pack
    assert data_kit.preprocess(*args, "--pack", "--neat-pack") == 0
    marks = IndexedTokens(f"{neat}_packed_attention_mask_document")
    labels = IndexedTokens(f"{neat}_packed_labels_document")
    bins = [marks.document_range_tokens(i, i + 1) for i in range(marks.num_documents)]
    assert len(bins) < len(data_kit.ALPACA) * 4 and all(len(b) == 32 for b in bins)
    for i, b in enumerate(bins):       # 1, 1, ..., 2, 2, ..., k, 0 ... 0 (padding, label -100)
        runs = [int(v) for j, v in enumerate(b) if j == 0 or v != b[j - 1]]
        assert runs in (list(range(1, len(runs) + 1)), list(range(1, len(runs))) + [0]), b
        assert (labels.document_range_tokens(i, i + 1)[b == 0] == -100).all()
    whole = ["--split", "100,0,0", "--reset-attention-mask", "--reset-position-ids", "--use-flash-attn"]
    with trainer_session(setup["flags"] + whole + ["--neat-pack", "--data-path", neat]) as (a, tokenizer, loss_of, datasets):
        kernels, calls = get_backend().kernels, []
        impl = kernels._impl["attention"]

        def recorded(*args, **kwargs):          # the real kernel; its layout and mask noted
            calls.append((kwargs.get("layout"), kwargs.get("mask") is None, len(kwargs.get("actual_seq_qlen") or [])))
            return impl(*args, **kwargs)
        kernels._impl["attention"] = recorded

        def total(prefix, neat_pack):       # every sample of the dataset, one forward each
            a.data_path, a.neat_pack = [prefix], neat_pack
            train = datasets(a)[0]
            # packed: no EOD given, so the stored sample numbers alone must place the documents
            pairs = [loss_of({k: v.unsqueeze(0) for k, v in train[i].items() if k != "length"},   # (an int)
                             **({"eod": None} if neat_pack else {})) for i in range(train.epoch_samples)]
            return len(pairs), sum(float(p[0]) for p in pairs), sum(int(p[1]) for p in pairs)
        try:
            n_bins, bin_loss, bin_tokens = total(neat, True)
        finally:
            kernels._impl["attention"] = impl
        train = datasets(a)[0]
        assert "attention_mask" not in train[0] and "segments" in train[0]
        # one TND call per layer and bin (in the split's order), maskless, as many sequences as the
        # bin has runs of numbers
        runs = [len([j for j, v in enumerate(b) if j == 0 or v != b[j - 1]]) for b in bins]
        layers = len(calls) // len(bins)
        assert layers >= 1 and sorted(calls) == sorted(("TND", True, n) for n in runs for _ in range(layers)), \
            (calls, runs)
        marks0, positions = train.samples.example(0)["segments"], train[0]["position_ids"].tolist()
        expected = [0 if j == 0 or m == 0 or m != marks0[j - 1] else None for j, m in enumerate(marks0)]
        for j, want in enumerate(expected):     # --reset-position-ids: 0 at each sample's start, then +1
            assert positions[j] == (positions[j - 1] + 1 if want is None else 0), (positions, marks0)
        n_alone, alone_loss, alone_tokens = total(str(root / "data" / "alpaca"), False)
    assert (n_bins, n_alone) == (len(bins), len(data_kit.ALPACA) * 4) and bin_tokens == alone_tokens
    assert abs(bin_loss - alone_loss) <= 1e-4 * alone_tokens, (bin_loss, alone_loss)
    for prefix, neat_pack, message in ((neat, False, "was written with --neat-pack; train with --neat-pack"),
                                       (str(root / "data" / "alpaca"), True, "was not written with --neat-pack")):
        with pytest.raises(DataError, match=message):
            instruction_data.build_splits(prefix, "100,0,0", 32, 1, 0, neat_pack)


def _train(flags, tmp_path, *extra) -> list[float]:
    """pretrain_gpt.py as a user runs it (one process); the losses it logged."""
    loss_file = str(tmp_path / "loss.jsonl")
    result = run_pretrain_gpt(*flags, "--log-loss-file", loss_file, *extra)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    losses = [json.loads(line)["lm_loss"] for line in open(loss_file)]
    assert losses and all(math.isfinite(x) for x in losses)
    return losses


def test_finetune_trains_from_the_converted_checkpoint_on_the_torch_trainer(setup, tmp_path):
    """The first logged loss is the masked loss of the loaded model on the first global batch."""
    losses = _train(setup["flags"], tmp_path, "--train-iters", "3")
    micro, sums = first_step(setup["flags"])
    expected = float(sum(s[0] for s in sums) / sum(s[1] for s in sums))   # tokens of all micro-batches
    assert len(losses) == 3 and abs(losses[0] - expected) < 1e-4, (losses, expected)


def test_finetune_on_the_mindspore_trainer_sees_the_same_masked_samples(setup, tmp_path):
    """Its micro-batches equal the torch trainer's; its first loss (the mean of the micro-batch
    losses, as its loop logs it) is the torch model's on them: the neutral copy loaded, prompts masked."""
    pytest.importorskip("mindspore")
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore import data as ms_data
    micro, sums = first_step(setup["flags"])
    args = parse_args(setup["flags"] + ["--backend", "mindspore"], world_size=1)
    _vocab, train, _valid = ms_data.build_streams(args, log=lambda m: None)
    for torch_batch, ms_batch in zip(micro, ms_data.micro_batches_for_step(train, 0, args, 0, 1)):
        for key in ("tokens", "labels", "loss_mask"):
            assert np.array_equal(torch_batch[key].numpy(), ms_batch[key]), key
    losses = _train(setup["flags"], tmp_path, "--backend", "mindspore", "--train-iters", "1", "--eval-iters", "0")
    expected = float(sum(s[0] / s[1] for s in sums) / len(sums))
    assert abs(losses[0] - expected) < 1e-4, (losses, expected)


def test_variable_seq_lengths_cuts_the_mindspore_micro_batches_as_the_torch_trainer_does(setup):
    """--variable-seq-lengths: each micro-batch as long as its longest sample on both trainers (the same
    arrays), shorter than --seq-length; without the flag, --seq-length long."""
    pytest.importorskip("mindspore")
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore import data as ms_data
    flags = setup["flags"] + ["--variable-seq-lengths"]
    with torch_trainer(flags) as (micro, _loss_of):     # the torch trainer's data path only
        pass
    args = parse_args(flags + ["--backend", "mindspore"], world_size=1)
    _vocab, train, _valid = ms_data.build_streams(args, log=lambda m: None)
    cut = ms_data.micro_batches_for_step(train, 0, args, 0, 1)
    assert any(b["tokens"].shape[1] < args.seq_length for b in cut), [b["tokens"].shape for b in cut]
    for torch_batch, ms_batch in zip(micro, cut):
        for key in ("tokens", "labels", "loss_mask"):
            assert np.array_equal(torch_batch[key].numpy(), ms_batch[key]), key
    args.variable_seq_lengths = False
    assert all(b["tokens"].shape[1] == args.seq_length for b in ms_data.micro_batches_for_step(train, 0, args, 0, 1))


@pytest.mark.parametrize("argv, message", [
    ([], "--is-instruction-dataset needs --data-path PREFIX"),
    (["--mock-data"], "--is-instruction-dataset needs --data-path PREFIX"),
    (["--data-path", "0.5", "a", "0.5", "b"], "--is-instruction-dataset needs --data-path PREFIX"),
    (["--data-path", "a", "--data-cache-path", "c"], "--data-cache-path: an instruction dataset"),
    (["--data-path", "a", "--neat-pack"], "--neat-pack needs --reset-attention-mask"),
])
def test_instruction_flag_without_one_instruction_dataset_is_refused(argv, message):
    from mindspeed.errors import ArgumentError
    from mindspeed.flags.trainer_flags import parse_args
    with pytest.raises(ArgumentError, match=re.escape(message)):
        parse_args(["--is-instruction-dataset", *argv], world_size=1)


def test_neat_pack_needs_an_instruction_dataset_and_the_torch_trainer():
    from mindspeed.adaptor_core import MindSpeedConfigError, plan
    from mindspeed.errors import ArgumentError
    from mindspeed.flags.trainer_flags import parse_args
    with pytest.raises(ArgumentError, match=re.escape("--neat-pack reads an instruction dataset")):
        parse_args(["--neat-pack", "--reset-attention-mask"], world_size=1)
    neat = ["--is-instruction-dataset", "--data-path", "a", "--neat-pack", "--reset-attention-mask"]
    # neat-packed sample numbers: the torch trainer's masks only (MindSpore's follow EOD tokens)
    with pytest.raises(MindSpeedConfigError, match="--neat-pack: the MindSpore trainer separates documents"):
        plan(neat + ["--backend", "mindspore"])


def test_a_pretraining_dataset_is_not_read_as_an_instruction_dataset(tmp_path):
    from mindspeed.data.errors import DataError
    from mindspeed.data.preprocess import PreprocessConfig, preprocess
    from mindspeed.training import data
    from mindspeed.flags.trainer_flags import parse_args
    (tmp_path / "a.txt").write_text("plain text " * 20)
    prefix = str(tmp_path / "plain")
    preprocess(PreprocessConfig(inputs=[str(tmp_path / "a.txt")], output_prefix=prefix), log=lambda m: None)
    args = parse_args(["--is-instruction-dataset", "--data-path", prefix], world_size=1)
    with pytest.raises(DataError, match="plain_packed_input_ids_document.*is missing"):
        data.resolve_data(args, log=lambda m: None)
