"""--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR on both trainers: a dataset
preprocessed with a Hugging Face tokenizer folder trains on the MindSpore trainer as on the torch
one, both taking the vocabulary (and its padding) from that tokenizer; a dataset holding ids beyond
the named tokenizer's vocabulary is refused in one line before training."""
import re

from tests_extend.system.one_process_run import run_pretrain_gpt
from tests_extend.unit import data_kit

TEXT = "the king loves the crown and the fool fears the sea " * 40
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--split", "90,10,0",
        "--tokenizer-type", "HuggingFaceTokenizer"]
VOCAB_LINE = re.compile(r"> data .*?: vocab (\d+) \(padded (\d+)\)")


def _dataset(tmp_path, name: str, tokenizer_dir: str, text: str = TEXT) -> str:
    source = data_kit.write_jsonl(str(tmp_path / f"{name}.jsonl"), [{"text": text + f" {i}"} for i in range(20)])
    prefix = str(tmp_path / name)
    assert data_kit.preprocess("--input", source, "--output-prefix", prefix, "--tokenizer-type",
                               "PretrainedFromHF", "--tokenizer-name-or-path", tokenizer_dir) == 0
    return prefix + "_text_document"        # MindSpeed-LLM's naming: PREFIX_<json key>_document


def _train(backend: str, prefix: str, tokenizer_dir: str):
    return run_pretrain_gpt("--backend", backend, *TINY, "--data-path", prefix, "--tokenizer-model", tokenizer_dir)


def test_both_trainers_take_the_vocabulary_from_the_named_tokenizer(tmp_path):
    tokenizer = data_kit.make_tokenizer(str(tmp_path / "tok"), extra_texts=[TEXT])
    prefix = _dataset(tmp_path, "corpus", tokenizer)
    vocabs = {}
    for backend in ("torch", "mindspore"):
        result = _train(backend, prefix, tokenizer)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "iteration        2/       2" in result.stdout, result.stdout[-2000:]
        vocabs[backend] = VOCAB_LINE.search(result.stdout).groups()
    assert vocabs["mindspore"] == vocabs["torch"], vocabs


def test_ids_beyond_the_named_tokenizer_are_refused_in_one_line(tmp_path):
    rare = " ".join(f"w{i}" for i in range(300))          # words only the big tokenizer knows
    big = data_kit.make_tokenizer(str(tmp_path / "big"), extra_texts=[TEXT + " " + rare])
    small = data_kit.make_tokenizer(str(tmp_path / "small"), extra_texts=[TEXT])
    prefix = _dataset(tmp_path, "corpus", big, TEXT + " " + rare)
    result = _train("mindspore", prefix, small)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "vocab" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "iteration" not in result.stdout
