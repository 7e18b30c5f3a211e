"""MindSpeed-RL's data preprocessing (`bash examples/data/preprocess_data.sh NAME` reading
configs/datasets/NAME.yaml) as `python -m mindspeed.data --config NAME`: the user guide's YAML
replayed on a tiny JSONL with a tiny tokenizer; R1AlpacaStyleInstructionHandler's prompts, the
qwen_r1 template, --dataset-additional-keys; YAML files refused in one line."""
from __future__ import annotations

import contextlib
import filecmp
import io
import os

import numpy as np
import pytest

from tests_extend.unit import data_kit as kit

pytest.importorskip("transformers")

# the guide's YAML (its section 3.3.3), keys and values as it writes them; the paths are substituted
GUIDE_YAML = """\
input: {input}
tokenizer_name_or_path: {tok}
output_prefix: {prefix}
cache_dir: {cache}
handler_name: R1AlpacaStyleInstructionHandler
tokenizer_type: HuggingFaceTokenizer
workers: 8
log_interval: 1000
prompt_type: qwen_r1
dataset_additional_keys: [labels]
map_keys: {{"prompt":"problem", "query":"", "response": "answer", "system":""}}
"""
# what MindSpeed-RL's qwen_r1 template renders for one question (its configs/model/templates.json)
R1_PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
             "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
             "The assistant first thinks about the reasoning process in the mind and then provides the user with "
             "the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> "
             "</answer> tags, respectively, i.e., <think> reasoning process here </think><answer> answer here "
             "</answer>. Put your final answer within \\boxed{{}}.\n{question}<|im_end|>\n<|im_start|>assistant\n")
MATH = [
    {"problem": "what is two plus three", "answer": "5", "level": "easy"},
    {"problem": "what is two times three", "answer": "6", "level": "hard"},
    {"problem": "count to three", "answer": "one two three", "level": "easy"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    words = [R1_PROMPT.format(question=""), "5 6 plus times level easy hard be brief"]
    return kit.make_tokenizer(str(tmp_path_factory.mktemp("tok")), extra_texts=words)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from mindspeed.data.tokenizer import HuggingFaceTokenizer
    return HuggingFaceTokenizer(tok_dir)


def _read(prefix: str, key: str) -> list[list[int]]:
    """Dataset PREFIX_packed_<key>_document through MindSpeed's reader (what the trainers use)."""
    from mindspeed.data.indexed_reader import check_dataset
    ds = check_dataset(f"{prefix}_packed_{key}_document")
    assert ds.tokens.dtype == np.int32                           # MindSpeed-RL's builders write int32
    return [ds.sequence(i).astype(np.int64).tolist() for i in range(ds.num_sequences)]


def _main(*argv: str) -> tuple[int, str, str]:
    from mindspeed.data.__main__ import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_the_guides_yaml_writes_r1_prompts_and_answer_labels(tok_dir, tok, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = kit.write_jsonl(tmp_path / "orz.jsonl", MATH)
    os.makedirs("configs/datasets")
    with open("configs/datasets/grpo_orz.yaml", "w") as f:
        f.write(GUIDE_YAML.format(input=data, tok=tok_dir, prefix=tmp_path / "out" / "orz", cache=tmp_path / "cache"))
    rc, out, err = _main("--config", "grpo_orz")       # configs/datasets/grpo_orz.yaml, as the guide's script
    assert rc == 0, err
    prefix = str(tmp_path / "out" / "orz")
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        [f"orz_packed_{k}_document.{e}" for k in ("input_ids", "attention_mask", "labels") for e in ("bin", "idx")]
        + ["orz.tokenizer.json"])
    ids, mask, labels = (_read(prefix, k) for k in ("input_ids", "attention_mask", "labels"))
    for record, prompt, ones, answer in zip(MATH, ids, mask, labels, strict=True):
        text = R1_PROMPT.format(question=record["problem"])
        assert prompt == tok.encode(text)                        # the prompt only: no answer, no end token
        assert prompt[-2:] == [tok.token_id("<|im_start|>"), tok.token_id("assistant")]
        assert ones == [1] * len(prompt)
        assert answer == tok.encode(record["answer"])            # the reference answer, unmasked
    assert "8 worker(s)" in out
    rc, out, _ = _main("--config", "grpo_orz")
    assert rc == 0 and "reused the cached result" in out        # the guide's cache_dir


def test_the_command_line_wins_over_the_file_and_other_additional_keys(tok_dir, tok, tmp_path):
    data = kit.write_jsonl(tmp_path / "orz.jsonl", MATH)
    config = tmp_path / "orz.yaml"
    config.write_text(GUIDE_YAML.format(input=data, tok=tok_dir, prefix=tmp_path / "ignored", cache=tmp_path / "c")
                      .replace("cache_dir", "# cache_dir"))
    prefix = str(tmp_path / "out" / "orz")
    rc, out, err = _main("--config", str(config), "--output-prefix", prefix, "--workers", "1",
                         "--dataset-additional-keys", "labels", "level")
    assert rc == 0, err
    assert "the command line overrides dataset_additional_keys, output_prefix, workers" in out
    assert not os.path.exists(tmp_path / "ignored_packed_input_ids_document.bin")
    assert _read(prefix, "level") == [tok.encode(r["level"]) for r in MATH]
    assert _read(prefix, "labels") == [tok.encode(r["answer"]) for r in MATH]


def test_r1_history_system_seq_length_and_null_answers(tok_dir, tok, tmp_path):
    records = [{"q": "say hello", "a": ["hello"], "sys": "be brief", "h": [["count to three", "one two three"]]},
               {"q": "name a colour", "a": None, "sys": "", "h": []},           # left out, as MindSpeed-RL
               {"q": "what is red", "a": "red is a colour", "sys": "", "h": []}]
    data = kit.write_jsonl(tmp_path / "h.jsonl", records)
    prefix = str(tmp_path / "h")
    base = ["--input", data, "--tokenizer-name-or-path", tok_dir, "--handler-name", "R1AlpacaStyleInstructionHandler",
            "--prompt-type", "qwen_r1", "--dataset-additional-keys", "labels",
            "--map-keys", '{"prompt": "q", "response": "a", "system": "sys", "history": "h"}']
    rc, out, err = _main(*base, "--output-prefix", prefix)
    assert rc == 0, err
    assert "left out 1 records with a null answer" in out
    first = (tok.encode("<|im_start|>system\nbe brief<|im_end|>\n")
             + tok.encode(R1_PROMPT.format(question="count to three").split("<|im_end|>\n", 1)[1])
             + tok.encode("one two three") + [tok.token_id("<|im_end|>")] + tok.encode("\n")
             + tok.encode(R1_PROMPT.format(question="say hello").split("<|im_end|>\n", 1)[1]))
    last = tok.encode(R1_PROMPT.format(question="what is red"))        # an empty system: the default one
    assert _read(prefix, "input_ids") == [first, last]
    assert _read(prefix, "labels") == [tok.encode("hello"), tok.encode("red is a colour")]
    # --n-subs 3: the null answer's part is empty; the joined files are the same
    rc, out, err = _main(*base, "--output-prefix", prefix + "subs", "--workers", "2", "--n-subs", "3")
    assert rc == 0, err
    for key in ("input_ids", "attention_mask", "labels"):
        for ext in (".bin", ".idx"):
            assert filecmp.cmp(f"{prefix}_packed_{key}_document{ext}", f"{prefix}subs_packed_{key}_document{ext}",
                               shallow=False)
    # seq_length: a record is kept only while each of its arrays is shorter (MindSpeed-RL's rule)
    assert len(first) > len(last)
    rc, out, err = _main(*base, "--output-prefix", prefix + "cut", "--seq-length", str(len(first)))
    assert rc == 0 and "dropped 1 longer than --seq-length" in out and _read(prefix + "cut", "input_ids") == [last]
    rc, out, err = _main(*base, "--output-prefix", prefix + "all", "--seq-length", str(len(first) + 1))
    assert rc == 0 and _read(prefix + "all", "input_ids") == [first, last]


YAML_REFUSALS = [
    ("input: [a.jsonl\n", "is not valid YAML (expected ',' or ']'"),
    ("- input\n- a.jsonl\n", "must be a mapping of flag names to values"),
    ("streaming: true\n", "unknown key 'streaming'"),
    ("worker: 2\n", "unknown key 'worker' (did you mean workers?)"),
    ("workers: eight\n", "workers must be an integer, got text 'eight'"),
    ("workers: true\n", "workers must be an integer, got true/false True"),
    ("pack: 2\n", "pack must be true or false"),
    ("map_keys: 3\n", "map_keys must be a mapping"),
    ("dataset_additional_keys: {labels: 1}\n", "dataset_additional_keys must be a list of texts"),
    ("tokenizer_type: Tiktoken\n", "tokenizer_type must be one of CharLevel, HuggingFaceTokenizer"),
    ("tokenizer_not_use_fast: true\n", "transformers 5 loads every tokenizer with its fast implementation"),
]


@pytest.mark.parametrize("text, message", YAML_REFUSALS, ids=[m[:28] for _, m in YAML_REFUSALS])
def test_a_bad_yaml_file_is_refused_in_one_line(tok_dir, tmp_path, text, message):
    data = kit.write_jsonl(tmp_path / "a.jsonl", MATH)
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    rc, out, err = _main("--config", str(config), "--input", data, "--tokenizer-name-or-path", tok_dir,
                         "--output-prefix", str(tmp_path / "o"))
    assert rc == 2 and message in err and err.count("\n") == 1, err
    assert str(config) in err or "tokenizer_not_use_fast" in err             # the file, or the key, is named
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "bad.yaml"]


R1_REFUSALS = [
    (["--pack", "--seq-length", "64"], "--pack: R1AlpacaStyleInstructionHandler writes one prompt per record"),
    (["--append-eod"], "--append-eod: R1AlpacaStyleInstructionHandler writes prompts"),
    (["--dataset-additional-keys", "input_ids"], "--dataset-additional-keys 'input_ids': each key names"),
    (["--dataset-additional-keys", "labels", "grade"], "a.jsonl:1: no 'grade' field (the --dataset-additional-keys"),
    (["--map-keys", '{"prompt": "problem", "response": "level_id"}'], "a.jsonl:1: field 'level_id' must be the answer"),
    (["--map-keys", '{"prompt": "problem"}'], "a.jsonl:1: no 'output' field"),
]


@pytest.mark.parametrize("flags, message", R1_REFUSALS, ids=[m[:28] for _, m in R1_REFUSALS])
def test_r1_refusals_are_one_line_and_write_nothing(tok_dir, tmp_path, flags, message):
    data = kit.write_jsonl(tmp_path / "a.jsonl", [{**r, "level_id": 3} for r in MATH])
    rc, out, err = _main("--input", data, "--tokenizer-name-or-path", tok_dir, "--output-prefix", str(tmp_path / "o"),
                         "--handler-name", "R1AlpacaStyleInstructionHandler", "--prompt-type", "qwen_r1",
                         "--map-keys", '{"prompt": "problem", "response": "answer"}', *flags)
    assert rc == 2 and message in err and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl"]


def test_additional_keys_belong_to_the_r1_handler(tok_dir, tmp_path):
    data = kit.write_jsonl(tmp_path / "a.jsonl", kit.ALPACA)
    rc, _, err = _main("--input", data, "--tokenizer-name-or-path", tok_dir, "--output-prefix", str(tmp_path / "o"),
                       "--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "qwen",
                       "--dataset-additional-keys", "labels")
    assert rc == 2 and "--dataset-additional-keys applies to R1AlpacaStyleInstructionHandler" in err
