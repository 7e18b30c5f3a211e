"""MindSpeed-LLM's tokenizer flags on the built-in trainers and the converter.

--tokenizer-type PretrainedFromHF --tokenizer-name-or-path DIR is Megatron's --tokenizer-type
HuggingFaceTokenizer --tokenizer-model DIR: the same parsed flags and, on the torch trainer, the same
losses. --padded-vocab-size N is the model's embedding and output rows (read back from the saved
checkpoint, on both trainers), survives a resume, and is what `python -m mindspeed.convert
--padded-vocab-size N` writes and prints for the trainer. Every bad input is one line before any
work: a missing tokenizer folder, one without tokenizer files, PretrainedFromHF without a folder,
two different folders, N below the vocabulary or not divisible by TP, a
checkpoint with fewer rows than N. (Megatron-LM's own pretrain_gpt.py:
tests_extend/system/test_megatron_lm_tokenizer_flags.py.)"""
from __future__ import annotations

import json
import os
import re

import pytest

from mindspeed.errors import ArgumentError
from mindspeed.flags.trainer_flags import parse_args
from tests_extend.system.one_process_run import run_pretrain_gpt
from tests_extend.unit import data_kit

pytest.importorskip("transformers")

TEXT = "the king loves the crown and the fool fears the sea " * 40
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--split", "90,10,0"]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
VOCAB_LINE = re.compile(r"> data .*?: vocab (\d+) \(padded (\d+)\)")
EMBEDDING = "embedding.word_embeddings.weight"
# the differences resolve_hf_alias leaves: what was typed, and the LLM spelling's own flag
SPELLING_ONLY = {"tokenizer_type_given", "tokenizer_name_or_path"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A Hugging Face tokenizer folder (67 tokens: padded to 128 by default) and a dataset made with it."""
    root = tmp_path_factory.mktemp("pretrained-from-hf")
    tok = data_kit.make_tokenizer(str(root / "tok"), extra_texts=[TEXT])
    source = data_kit.write_jsonl(str(root / "corpus.jsonl"), [{"text": TEXT + f" {i}"} for i in range(20)])
    assert data_kit.preprocess("--input", source, "--output-prefix", str(root / "corpus"), "--tokenizer-type",
                               "PretrainedFromHF", "--tokenizer-name-or-path", tok) == 0
    return {"root": root, "tok": tok, "data": str(root / "corpus_text_document")}


def llm(tok: str) -> list[str]:
    return ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tok]


def megatron(tok: str) -> list[str]:
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok]


def _train(*argv: str):
    result = run_pretrain_gpt(*TINY, *argv)
    return result, [loss for _, loss in LOSS.findall(result.stdout)]


def _one_error_line(result) -> str:
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "iteration " not in result.stdout
    return errors[0]


# --- parsing -------------------------------------------------------------------------------------
def test_both_spellings_parse_to_the_same_flags(corpus):
    tok = corpus["tok"]
    for backend in ("torch", "mindspore"):
        ours = vars(parse_args(["--backend", backend, *llm(tok), "--padded-vocab-size", "256"], world_size=1))
        theirs = vars(parse_args(["--backend", backend, *megatron(tok), "--padded-vocab-size", "256"], world_size=1))
        assert (ours["tokenizer_type"], ours["tokenizer_model"], ours["padded_vocab_size"]) == \
            ("HuggingFaceTokenizer", tok, 256)
        assert {k: v for k, v in ours.items() if k not in SPELLING_ONLY} == \
            {k: v for k, v in theirs.items() if k not in SPELLING_ONLY}
    # both folder flags naming one folder is one tokenizer
    assert parse_args([*llm(tok), "--tokenizer-model", tok], world_size=1).tokenizer_model == tok


def _refusals(root, tok):
    empty, afile = os.path.join(root, "empty"), os.path.join(tok, "tokenizer.json")
    os.makedirs(empty, exist_ok=True)
    return [
        (["--tokenizer-type", "PretrainedFromHF"], 1,
         "--tokenizer-type PretrainedFromHF needs --tokenizer-name-or-path DIR"),
        (llm(os.path.join(root, "missing")), 1, "--tokenizer-name-or-path '" + os.path.join(root, "missing")
         + "' does not exist"),
        (llm(empty), 1, "holds no tokenizer files (tokenizer.json, tokenizer_config.json or a vocabulary file)"),
        (llm(afile), 1, "is a file, not a tokenizer folder"),
        (megatron(empty), 1, "--tokenizer-model '" + empty + "' holds no tokenizer files"),
        ([*llm(tok), "--tokenizer-model", empty], 1, "name different tokenizers: give one"),
        (["--tokenizer-name-or-path", tok], 1,
         "--tokenizer-name-or-path is read only by --tokenizer-type PretrainedFromHF"),
        ([*llm(tok), "--padded-vocab-size", "255", "--tensor-model-parallel-size", "2"], 2,
         "--padded-vocab-size 255 is not divisible by --tensor-model-parallel-size 2"),
        ([*llm(tok), "--padded-vocab-size", "0"], 1, "--padded-vocab-size must be a positive integer"),
    ]


def test_bad_tokenizer_flags_are_refused_in_one_line(corpus):
    for argv, world, message in _refusals(str(corpus["root"]), corpus["tok"]):
        with pytest.raises(ArgumentError) as err:
            parse_args(argv, world_size=world)
        lines = str(err.value).splitlines()
        assert len(lines) == 1 and message in lines[0], (argv, lines)


# --- the torch trainer ---------------------------------------------------------------------------
def test_pretrained_from_hf_trains_as_huggingface_tokenizer(corpus, tmp_path):
    """Same losses from both spellings; --padded-vocab-size 256 is the saved embedding's rows, the
    run's recorded flags (what generate/evaluate rebuild from) and what a resume builds."""
    data = ["--data-path", corpus["data"], "--train-iters", "2"]
    theirs, theirs_losses = _train(*data, *megatron(corpus["tok"]))
    ours, ours_losses = _train(*data, *llm(corpus["tok"]))
    for result in (theirs, ours):
        assert result.returncode == 0, result.stderr[-3000:]
        assert VOCAB_LINE.search(result.stdout).groups() == ("67", "128")
    assert len(ours_losses) == 2 and ours_losses == theirs_losses

    save = str(tmp_path / "ckpt")
    padded, padded_losses = _train(*data, *llm(corpus["tok"]), "--padded-vocab-size", "256", "--save", save,
                                   "--save-interval", "2")
    assert padded.returncode == 0, padded.stderr[-3000:]
    assert VOCAB_LINE.search(padded.stdout).groups() == ("67", "256")
    assert padded_losses != ours_losses          # 256 output rows: another softmax
    from mindspeed.checkpoint.megatron_read import TorchDistReader
    assert TorchDistReader(os.path.join(save, "iter_0000002")).shape(EMBEDDING) == (256, 16)
    from mindspeed.generate.model_source import read_source
    assert read_source(save, world_size=1).args.padded_vocab_size == 256
    resumed, resumed_losses = _train("--data-path", corpus["data"], "--train-iters", "3", *llm(corpus["tok"]),
                                     "--padded-vocab-size", "256", "--load", save)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"> loaded checkpoint {save} at iteration 2" in resumed.stdout and len(resumed_losses) == 1


def test_padded_vocab_size_the_trainer_cannot_honour_is_one_line(corpus, tmp_path):
    data = ["--data-path", corpus["data"], "--train-iters", "1"]
    small = _one_error_line(_train(*data, *llm(corpus["tok"]), "--padded-vocab-size", "64")[0])
    assert "--padded-vocab-size 64 is smaller than the tokenizer's vocabulary (67 tokens)" in small
    save = str(tmp_path / "ckpt128")
    assert _train(*data, *llm(corpus["tok"]), "--save", save, "--save-interval", "1")[0].returncode == 0
    fewer = _one_error_line(_train(*data, *llm(corpus["tok"]), "--padded-vocab-size", "256", "--load", save)[0])
    assert "has 128 vocabulary rows, fewer than --padded-vocab-size 256" in fewer
    assert "give --padded-vocab-size 128" in fewer


# --- the MindSpore trainer -----------------------------------------------------------------------
def test_mindspore_trainer_takes_the_llm_spelling_and_the_padded_rows(corpus, tmp_path):
    pytest.importorskip("mindspore")
    save = str(tmp_path / "ms")
    result, losses = _train("--backend", "mindspore", "--data-path", corpus["data"], "--train-iters", "2",
                            *llm(corpus["tok"]), "--padded-vocab-size", "256", "--save", save, "--save-interval", "2")
    assert result.returncode == 0 and len(losses) == 2, result.stderr[-3000:]
    assert VOCAB_LINE.search(result.stdout).groups() == ("67", "256")
    from mindspeed.checkpoint import neutral
    model, _, _ = neutral.load(save)
    assert model[EMBEDDING].shape == (256, 16)
    small = _one_error_line(_train("--backend", "mindspore", "--data-path", corpus["data"], "--train-iters", "1",
                                   *llm(corpus["tok"]), "--padded-vocab-size", "64")[0])
    assert "--padded-vocab-size 64 is smaller than the tokenizer's vocabulary (67 tokens)" in small


# --- the converter -------------------------------------------------------------------------------
def _convert(*argv: str) -> tuple[int, str]:
    import contextlib
    import io
    from mindspeed.convert.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(list(argv))
    return rc, err.getvalue()


def test_the_converter_writes_the_rows_the_trainer_builds(corpus, tmp_path):
    """hf->mg --padded-vocab-size 256: 256 rows, the flag among the trainer flags it records, and the
    trainer fine-tunes from it with those flags; the way back gives the tokenizer's rows as they were."""
    from tests_extend.unit import convert_kit
    import torch
    hf, mg, mg128 = str(tmp_path / "hf"), str(tmp_path / "mg"), str(tmp_path / "mg128")
    convert_kit.make_hf_model(hf, "llama", num_hidden_layers=2)
    hf_to_mg = ["--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "llama2", "--load-dir", hf,
                "--tokenizer-model", os.path.join(corpus["tok"], "tokenizer.json")]
    assert _convert(*hf_to_mg, "--save-dir", mg, "--padded-vocab-size", "256") == (0, "")
    with open(os.path.join(mg, "convert_info.json")) as f:
        info = json.load(f)
    assert info["padded_vocab_size"] == 256 and info["vocab_size"] == 67
    flags = info["trainer_flags"]
    assert flags[flags.index("--padded-vocab-size") + 1] == "256"
    from mindspeed.checkpoint.megatron_read import TorchDistReader
    assert TorchDistReader(os.path.join(mg, "iter_0000000")).shape(EMBEDDING) == (256, convert_kit.HIDDEN)
    from mindspeed.generate.model_source import read_source
    assert read_source(mg, world_size=1).args.padded_vocab_size == 256

    run = [*flags, "--load", mg, "--finetune", "--data-path", corpus["data"], *llm(corpus["tok"]), "--seq-length",
           "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1", "--log-interval", "1",
           "--eval-iters", "0", "--split", "90,10,0"]
    trained = run_pretrain_gpt(*run)
    assert trained.returncode == 0 and LOSS.search(trained.stdout), trained.stderr[-3000:]
    assert VOCAB_LINE.search(trained.stdout).groups() == ("67", "256")

    back = str(tmp_path / "back")
    assert _convert("--load-model-type", "mg", "--save-model-type", "hf", "--model-type-hf", "llama2", "--load-dir",
                    mg, "--save-dir", back, "--hf-config", hf) == (0, "")
    want, got = convert_kit.read_safetensors(hf), convert_kit.read_safetensors(back)
    name = "model.embed_tokens.weight"
    assert got[name].shape == want[name].shape and torch.equal(got[name][:67], want[name][:67])

    # a conversion without the flag writes 128 rows: a run asking for 256 is refused, not half loaded
    assert _convert(*hf_to_mg, "--save-dir", mg128) == (0, "")
    fewer = _one_error_line(run_pretrain_gpt(*[mg128 if a == mg else a for a in run]))
    assert "has 128 vocabulary rows, fewer than --padded-vocab-size 256" in fewer


@pytest.mark.parametrize("extra, message", [
    (["--padded-vocab-size", "100"], "--padded-vocab-size 100 is smaller than the vocabulary (128, config.json's)"),
    (["--padded-vocab-size", "255", "--target-tensor-parallel-size", "2"],
     "--padded-vocab-size 255 is not divisible by --target-tensor-parallel-size 2"),
])
def test_the_converter_refuses_rows_it_cannot_write_in_one_line(tmp_path, extra, message):
    from tests_extend.unit import convert_kit
    hf, mg = str(tmp_path / "hf"), str(tmp_path / "mg")
    convert_kit.make_hf_model(hf, "llama", num_hidden_layers=2)
    rc, err = _convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir", mg,
                       *extra)
    assert rc == 1 and err.count("\n") == 1 and message in err, err
    assert not os.path.exists(mg)


def test_the_way_back_refuses_padded_vocab_size(tmp_path):
    rc, err = _convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(tmp_path),
                       "--save-dir", str(tmp_path / "back"), "--padded-vocab-size", "256")
    assert rc == 1 and err.count("\n") == 1 and "--padded-vocab-size sets the rows hf->mg writes" in err, err
