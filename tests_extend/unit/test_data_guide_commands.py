"""The data preprocessing commands of a MindSpeed-LLM user guide (its section 3.3: pretraining on
open-web-math's parquet shards, Alpaca fine-tuning) and of the ShareGPT page its table links, run as
written -- line continuations and shell comments kept -- on tiny data and a word-level tokenizer
built here. Only paths move: absolute ones under a temporary directory, relative ones (the guide's
./dataset, ./model_from_hf, ./finetune_dataset) from a temporary working directory, and
MindSpeed-LLM's `preprocess_data.py` is MindSpeed's tests_extend/example/preprocess_data.py (the
same flags as `python -m mindspeed.data`), run in this process."""
from __future__ import annotations

import contextlib
import filecmp
import io
import json
import os
import runpy
import shlex
import sys

import numpy as np
import pytest

from mindspeed.data.handlers import IGNORE_INDEX
from tests_extend.unit import data_kit as kit

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

PROGRAM = os.path.join(os.path.dirname(__file__), "..", "example", "preprocess_data.py")
ABSOLUTE = "/home/ma-user/work"          # the guide's absolute paths start here

# the commands, character for character (tabs, comments and the commented-out --map-keys included)
GUIDE = {
    # the guide's 3.3.1
    "pretrain": r"""python preprocess_data.py \
	--input /home/ma-user/work/datasets/open-web-math/open-web-math/data/ \
	--tokenizer-name-or-path /home/ma-user/work/models/Qwen/Qwen2.5-7B/ \
	--tokenizer-type PretrainedFromHF \
	--handler-name GeneralPretrainHandler \
	--cache-dir /home/ma-user/work/datasets/cache_dir \
	--output-prefix /home/ma-user/work/datasets/mindspeed/open-web-math \
	--json-keys text \
	--workers 16  \
	--n-subs 16 \
	--log-interval 1000""",
    # the guide's 3.3.2 (also MindSpeed-LLM's docs/features/alpaca_dataset.md)
    "alpaca": r"""python ./preprocess_data.py \
    --input ./dataset/train-00000-of-00001-a09b74b3ef9c3b56.parquet \
    --tokenizer-name-or-path ./model_from_hf/llama-2-7b-hf/ \
    --output-prefix ./finetune_dataset/alpaca \
    --workers 4 \
    --log-interval 1000 \
    --tokenizer-type PretrainedFromHF \
    --handler-name AlpacaStyleInstructionHandler \
    --prompt-type llama2  # <-- 需要填入模型模板
    # --map-keys '{"prompt":"instruction","query":"input","response":"output"}' # 默认值，可不传""",
    # MindSpeed-LLM's docs/features/sharegpt_dataset.md, the ShareGPT and the OpenAI-format commands
    "sharegpt": r"""python ./preprocess_data.py \
    --input ./dataset/sharegpt_formatted_data-evol-gpt4.jsonl \
    --tokenizer-name-or-path ./model_from_hf/llama-2-7b-hf/ \
    --output-prefix ./finetune_dataset/sharegpt \
    --workers 4 \
    --log-interval 1000 \
    --tokenizer-type PretrainedFromHF \
    --handler-name SharegptStyleInstructionHandler \
    --prompt-type llama2  # <-- 需要填入模型模板
    # --map-keys '{"messages":"conversations", "tags":{"role_tag": "from","content_tag": "value","user_tag": "human","assistant_tag": "gpt","system_tag": "system", "observation_tag":"observation", "function_tag":"function_call"}}' # 默认值，可不传""",
    "openai": r"""python ./preprocess_data.py \
    --input ./dataset/xxx.json \
    --tokenizer-name-or-path ./model_from_hf/llama-2-7b-hf/ \
    --output-prefix ./finetune_dataset/openai \
    --workers 4 \
    --log-interval 1000 \
    --tokenizer-type PretrainedFromHF \
    --handler-name SharegptStyleInstructionHandler \
    --prompt-type llama2 \
    --map-keys '{"messages":"messages", "tags":{"role_tag": "role","content_tag": "content","user_tag": "user","assistant_tag": "assistant","system_tag": "system"}}'""",
}
# alpaca_dataset.md: with system and history columns, the guide's --map-keys names them all
ALPACA_FULL_MAP_KEYS = '{"prompt":"instruction","query":"input","response":"output","system":"system","history":"history"}'

# open-web-math's columns; three shards of the corpus
CORPUS = [
    "the cat is an animal", "say hello to the cat", "blue is a colour", "red is a colour",
    "one two three", "count to three", "two and three", "five", "hello cat", "name a colour",
]
CORPUS += CORPUS[::-1]                # 20 rows: --n-subs 16 makes 16 parts
SHARDS = [CORPUS[0:8], CORPUS[8:14], CORPUS[14:20]]
# an Alpaca parquet: optional system prompt and history, nulls where a record has none (as parquet holds them)
ALPACA = [dict(record, system=None, history=[]) for record in kit.ALPACA]
ALPACA[1] = dict(ALPACA[1], system="be short", history=[["say hello", "hello"]])
ALPACA_COPIES = 170                   # 1020 records: one --log-interval 1000 progress line
CALL = {"name": "get_colour", "arguments": {"thing": "sky"}}
CALL_TEXT = 'Action: get_colour\nAction Input: {"thing": "sky"}'
# ShareGPT as the page shows it: human / function_call / observation / gpt turns, a system turn first
SHAREGPT = kit.SHAREGPT + [{"conversations": [
    {"from": "human", "value": "what is red"}, {"from": "function_call", "value": json.dumps(CALL)},
    {"from": "observation", "value": "blue"}, {"from": "gpt", "value": "blue is a colour"}]}]
ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
OPENAI = [{"messages": [{"role": ROLES[t["from"]], "content": t["value"]} for t in r["conversations"]]}
          for r in kit.SHAREGPT]


def guide_argv(command: str, root) -> list[str]:
    """The program's arguments of a guide command as a shell splits it, absolute paths under `root`."""
    words = shlex.split(command.replace(ABSOLUTE, f"{root}{ABSOLUTE}").replace("\\\n", " "), comments=True)
    assert words[0] == "python" and os.path.basename(words[1]) == "preprocess_data.py", words
    return words[2:]


def replay(argv: list[str]) -> tuple[int, str, str]:
    """MindSpeed's preprocess_data.py with `argv`, in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv, list(sys.path)
    sys.argv = [PROGRAM, *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(PROGRAM, run_name="__main__")
        rc = 0
    except SystemExit as exc:
        rc = exc.code
    finally:
        sys.argv, sys.path[:] = saved          # the program puts the repository first on sys.path
    return rc, out.getvalue(), err.getvalue()


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def with_flag(argv: list[str], name: str, value: str) -> list[str]:
    argv = list(argv)
    argv[argv.index(name) + 1] = value
    return argv


def read(prefix: str) -> list[list[int]]:
    """Dataset PREFIX through MindSpeed's indexed reader (what both trainers read)."""
    from mindspeed.data.indexed_reader import check_dataset
    ds = check_dataset(prefix)
    return [ds.sequence(i).astype(np.int64).tolist() for i in range(ds.num_sequences)]


def read_instruction(prefix: str) -> list[tuple[list[int], list[int]]]:
    ids, mask, labels = (read(f"{prefix}_packed_{k}_document") for k in ("input_ids", "attention_mask", "labels"))
    assert mask == [[1] * len(x) for x in ids]
    return list(zip(ids, labels, strict=True))


def outputs(prefix: str, keys) -> list[str]:
    return sorted([f"{prefix}_{k}_document.{e}" for k in keys for e in ("bin", "idx")])


def same_text(decoded: str, text: str) -> bool:
    # the word-level tokenizer decodes with a space between tokens: compare without whitespace
    return bool(decoded.split()) and "".join(decoded.split()) == "".join(text.split())


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return kit.make_tokenizer(str(tmp_path_factory.mktemp("tok")), extra_texts=[CALL_TEXT, "what is red sky"])


@pytest.fixture(scope="module")
def tok(tok_dir):
    from mindspeed.data.tokenizer import HuggingFaceTokenizer
    return HuggingFaceTokenizer(tok_dir)


def _install_tokenizer(tok_dir: str, target) -> None:
    os.makedirs(target, exist_ok=True)
    for name in os.listdir(tok_dir):
        with open(os.path.join(tok_dir, name), "rb") as src, open(os.path.join(target, name), "wb") as dst:
            dst.write(src.read())


def _write_parquet(path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))


def test_the_guides_pretraining_command(tok_dir, tok, tmp_path):
    """3.3.1: every shard of the directory, in order, one document per row of the text column (no
    end token: the guide has no --append-eod); 16 parts in 16 workers give the bytes one worker
    writes; the second run copies the result from --cache-dir."""
    argv = guide_argv(GUIDE["pretrain"], tmp_path)
    _install_tokenizer(tok_dir, flag(argv, "--tokenizer-name-or-path"))
    data = flag(argv, "--input")
    for i, texts in enumerate(SHARDS):
        _write_parquet(os.path.join(data, f"train-{i:05d}-of-{len(SHARDS):05d}.parquet"),
                       [{"url": f"https://example.org/{t}", "text": t, "date": "2023", "metadata": "{}"}
                        for t in texts])
    prefix = flag(argv, "--output-prefix")          # its folder is created (the guide makes none)
    rc, out, err = replay(argv)
    assert rc == 0, err
    assert "16 worker(s)" in out and "processed" not in out      # fewer records than --log-interval
    written = prefix + "_text_document"
    assert sorted(os.listdir(os.path.dirname(prefix))) == sorted(
        os.path.basename(p) for p in outputs(prefix, ["text"]) + [written + ".tokenizer.json"])
    docs = read(written)
    assert docs == [tok.encode(text) for text in CORPUS]
    assert same_text(tok.detokenize(docs[1]), CORPUS[1])
    with open(written + ".tokenizer.json") as f:            # the trainers find the tokenizer folder again
        assert json.load(f)["name"] == os.path.abspath(flag(argv, "--tokenizer-name-or-path"))
    # the same command with one worker and no parts: the same bytes
    single = with_flag(with_flag(with_flag(argv, "--workers", "1"), "--n-subs", "1"),
                       "--output-prefix", str(tmp_path / "single"))
    single.remove("--cache-dir")
    single.remove(flag(argv, "--cache-dir"))
    rc, out, err = replay(single)
    assert rc == 0, err
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(written + ext, str(tmp_path / "single_text_document") + ext, shallow=False)
    # --cache-dir holds the result; the guide's command again copies it
    entries = os.listdir(os.path.join(flag(argv, "--cache-dir"), "preprocessed"))
    assert len(entries) == 1
    before = _contents(written)
    for ext in (".bin", ".idx"):
        os.remove(written + ext)
    rc, out, err = replay(argv)
    assert rc == 0 and "reused the cached result" in out and "worker(s)" not in out, out + err
    assert _contents(written) == before


def _contents(prefix: str) -> dict[str, bytes]:
    contents = {}
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as f:
            contents[ext] = f.read()
    return contents


def _llama2_turns(tok, system, pairs) -> list[tuple[list[int], list[int]]]:
    """Llama 2's rendering: each question `<s>[INST] ... [/INST]`, the system block inside the first,
    each reply ended by `</s>`."""
    turns = []
    for i, (question, reply) in enumerate(pairs):
        if i == 0 and system:
            question = f"<<SYS>>\n{system}\n<</SYS>>\n\n{question}"
        turns.append(([tok.bos_id] + tok.encode(f"[INST] {question} [/INST]"), tok.encode(reply) + [tok.eos_id]))
    return turns


def _assert_samples(tok, samples, conversations) -> None:
    """Each sample is its conversation rendered with llama2; labels mask every prompt token."""
    assert len(samples) == len(conversations)
    for (ids, labels), (system, pairs) in zip(samples, conversations, strict=True):
        turns = _llama2_turns(tok, system, pairs)
        assert ids == [t for prompt, reply in turns for t in prompt + reply]
        assert labels == [t for prompt, reply in turns for t in [IGNORE_INDEX] * len(prompt) + reply]
        assert kit.SPECIALS.index("<unk>") not in ids            # every word known: a wrong text shows


def _alpaca_pairs(record: dict, full: bool) -> tuple[str | None, list]:
    question = "\n".join(t for t in (record["instruction"], record["input"]) if t)
    history = [tuple(pair) for pair in record["history"]] if full else []
    return (record["system"] if full else None), history + [(question, record["output"])]


def _in_guide_tree(tok_dir, root, monkeypatch) -> None:
    """A working directory as the guide's: the model under ./model_from_hf, `mkdir ./finetune_dataset`."""
    monkeypatch.chdir(root)
    _install_tokenizer(tok_dir, "model_from_hf/llama-2-7b-hf")
    os.makedirs("finetune_dataset")
    os.makedirs("dataset")


def test_the_guides_alpaca_command(tok_dir, tok, tmp_path, monkeypatch):
    """3.3.2 on an Alpaca parquet with system and history columns: without --map-keys they are not
    read (the default names instruction/input/output only); with the page's full --map-keys the
    system prompt and the earlier turns are rendered (their replies learned too). One progress line
    at --log-interval 1000; the files are the ones the page lists."""
    _in_guide_tree(tok_dir, tmp_path, monkeypatch)
    argv = guide_argv(GUIDE["alpaca"], tmp_path)
    _write_parquet(flag(argv, "--input"), ALPACA * ALPACA_COPIES)
    rc, out, err = replay(argv)
    assert rc == 0, err
    assert out.count("processed 1000 records") == 1 and "processed" not in out.replace("processed 1000", "")
    assert sorted(os.listdir("finetune_dataset")) == sorted(
        os.path.basename(p) for p in outputs("alpaca_packed", ["input_ids", "attention_mask", "labels"])
        + ["alpaca.tokenizer.json"])
    samples = read_instruction("finetune_dataset/alpaca")
    _assert_samples(tok, samples, [_alpaca_pairs(r, full=False) for r in ALPACA] * ALPACA_COPIES)
    ids, labels = samples[1]
    assert same_text(tok.detokenize(ids), "<s>[INST] add the numbers\ntwo and three [/INST]five</s>")
    assert same_text(tok.detokenize([t for t in labels if t != IGNORE_INDEX]), "five</s>")
    # the commented-out --map-keys line, uncommented with the page's full mapping
    full = guide_argv(GUIDE["alpaca"].replace("llama2  # <-- ", "llama2 --map-keys '"
                                              + ALPACA_FULL_MAP_KEYS + "' # <-- "), tmp_path)
    full = with_flag(full, "--output-prefix", "./finetune_dataset/alpaca_full")
    rc, out, err = replay(full)
    assert rc == 0, err
    _assert_samples(tok, read_instruction("finetune_dataset/alpaca_full"),
                    [_alpaca_pairs(r, full=True) for r in ALPACA] * ALPACA_COPIES)
    # --workers 4 writes what one worker writes
    rc, out, err = replay(with_flag(with_flag(full, "--workers", "1"), "--output-prefix", "./one"))
    assert rc == 0, err
    for key in ("input_ids", "attention_mask", "labels"):
        for ext in (".bin", ".idx"):
            assert filecmp.cmp(f"finetune_dataset/alpaca_full_packed_{key}_document{ext}",
                               f"one_packed_{key}_document{ext}", shallow=False)


def _sharegpt_pairs(record: dict, key: str, role: str, content: str) -> tuple[str | None, list]:
    turns = record[key]
    system = turns[0][content] if turns[0][role] == "system" else None
    turns = turns[1:] if system else turns
    texts = [CALL_TEXT if t[role] == "function_call" else t[content] for t in turns]
    return system, list(zip(texts[::2], texts[1::2]))


@pytest.mark.parametrize("command", ["sharegpt", "openai"])
def test_the_sharegpt_pages_commands(tok_dir, tok, tmp_path, monkeypatch, command):
    """sharegpt_dataset.md's two commands: ShareGPT JSON lines with the default --map-keys (a tool
    call learned like a reply, the tool's result masked like a question: llama2 renders it as a
    user turn), and an OpenAI-format JSON array with its --map-keys."""
    _in_guide_tree(tok_dir, tmp_path, monkeypatch)
    argv = guide_argv(GUIDE[command], tmp_path)
    if command == "sharegpt":
        kit.write_jsonl(flag(argv, "--input"), SHAREGPT)
        expected = [_sharegpt_pairs(r, "conversations", "from", "value") for r in SHAREGPT]
    else:
        with open(flag(argv, "--input"), "w", encoding="utf-8") as f:
            json.dump(OPENAI, f, ensure_ascii=False, indent=2)
        expected = [_sharegpt_pairs(r, "messages", "role", "content") for r in OPENAI]
    rc, out, err = replay(argv)
    assert rc == 0, err
    assert "4 worker(s)" in out
    prefix = flag(argv, "--output-prefix")
    assert sorted(os.listdir("finetune_dataset")) == sorted(
        os.path.basename(p) for p in outputs(os.path.basename(prefix) + "_packed",
                                             ["input_ids", "attention_mask", "labels"])
        + [os.path.basename(prefix) + ".tokenizer.json"])
    samples = read_instruction(prefix)
    _assert_samples(tok, samples, expected)
    ids, labels = samples[0]
    assert same_text(tok.detokenize(ids), "<s>[INST] <<SYS>>\nbe short\n<</SYS>>\n\nsay hello [/INST]hello</s>"
                                          "<s>[INST] name a colour [/INST]blue</s>")
    assert same_text(tok.detokenize([t for t in labels if t != IGNORE_INDEX]), "hello</s>blue</s>")
