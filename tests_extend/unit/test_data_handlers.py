"""MindSpeed-LLM-style preprocessing (`python -m mindspeed.data --handler-name ...`): the datasets it
writes, token for token; chat templates; prompt masking; packing; workers; the cache; refusals."""
from __future__ import annotations

import filecmp
import glob
import json
import os

import numpy as np
import pytest

from mindspeed.data.handlers import IGNORE_INDEX
from tests_extend.unit import data_kit as kit

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return kit.make_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tok(tok_dir):
    from mindspeed.data.tokenizer import HuggingFaceTokenizer
    return HuggingFaceTokenizer(tok_dir)


def _docs(prefix: str) -> list[np.ndarray]:
    from mindspeed.data.indexed_reader import check_dataset
    ds = check_dataset(prefix)
    return [ds.sequence(i).astype(np.int64) for i in range(ds.num_sequences)]


def _instruction(prefix: str) -> list[tuple[np.ndarray, np.ndarray]]:
    ids, labels = (_docs(f"{prefix}_packed_{k}_document") for k in ("input_ids", "labels"))
    assert [len(x) for x in _docs(f"{prefix}_packed_attention_mask_document")] == [len(x) for x in ids]
    return list(zip(ids, labels))


def _run(tok_dir, data, prefix, *flags):
    rc = kit.preprocess("--input", data, "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tok_dir,
                        "--output-prefix", prefix, *flags)
    assert rc == 0


def test_alpaca_llama2_masks_exactly_the_prompt(tok_dir, tok, tmp_path):
    data = kit.write_jsonl(tmp_path / "a.jsonl", kit.ALPACA)
    prefix = str(tmp_path / "out" / "alpaca")
    _run(tok_dir, data, prefix, "--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "llama2")
    samples = _instruction(prefix)
    assert len(samples) == len(kit.ALPACA)
    for record, (ids, labels) in zip(kit.ALPACA, samples):
        question = "\n".join(t for t in (record["instruction"], record["input"]) if t)
        prompt = [tok.bos_id] + tok.encode(f"[INST] {question} [/INST]")
        reply = tok.encode(record["output"]) + [tok.eos_id]
        assert ids.tolist() == prompt + reply
        assert labels.tolist() == [IGNORE_INDEX] * len(prompt) + reply
    assert os.path.isfile(prefix + ".tokenizer.json")           # the trainer's --data-path is PREFIX


def test_alpaca_history_and_system_columns_with_llama2(tok_dir, tok, tmp_path):
    """Earlier [question, reply] pairs are turns of their own (their replies learned too); the
    system prompt goes inside the first [INST] block, as Llama 2 has it."""
    record = {"instruction": "count to three", "input": "", "output": "one two three", "sys": "be short",
              "past": [["say hello", "hello"]]}
    data = kit.write_jsonl(tmp_path / "a.jsonl", [record])
    prefix = str(tmp_path / "history")
    _run(tok_dir, data, prefix, "--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "llama2",
         "--map-keys", '{"system": "sys", "history": "past"}')
    (ids, labels), = _instruction(prefix)
    turns = [([tok.bos_id] + tok.encode("[INST] <<SYS>>\nbe short\n<</SYS>>\n\nsay hello [/INST]"),
              tok.encode("hello") + [tok.eos_id]),
             ([tok.bos_id] + tok.encode("[INST] count to three [/INST]"), tok.encode("one two three") + [tok.eos_id])]
    assert ids.tolist() == [t for prompt, reply in turns for t in prompt + reply]
    assert labels.tolist() == [t for prompt, reply in turns for t in [IGNORE_INDEX] * len(prompt) + reply]


@pytest.mark.parametrize("prompt_type, prompt_text, stop", [
    ("qwen", "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
             "<|im_start|>assistant\n", "<|im_end|>"),
    ("chatml", "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>"),
    ("alpaca", "Below is an instruction that describes a task. Write a response that appropriately completes the "
               "request.\n\n### Instruction:\n{q}\n\n### Response:\n", "</s>"),
    ("empty", "{q}", None),
])
def test_named_templates_render_prompt_and_reply_end(tok_dir, tok, tmp_path, prompt_type, prompt_text, stop):
    data = kit.write_jsonl(tmp_path / "a.jsonl", kit.ALPACA[:1])
    prefix = str(tmp_path / prompt_type)
    _run(tok_dir, data, prefix, "--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", prompt_type)
    (ids, labels), = _instruction(prefix)
    prompt = tok.encode(prompt_text.replace("{q}", kit.ALPACA[0]["instruction"]))
    reply = tok.encode(kit.ALPACA[0]["output"]) + ([tok.token_id(stop)] if stop else [])
    assert ids.tolist() == prompt + reply and labels.tolist() == [IGNORE_INDEX] * len(prompt) + reply


def test_sharegpt_multi_turn_with_the_tokenizers_chat_template(tok_dir, tok, tmp_path):
    """Every assistant turn is learned, every user/system turn masked; renamed columns via --map-keys."""
    renamed = [{"chat": [{"who": {"human": "u", "gpt": "a", "system": "s"}[t["from"]], "text": t["value"]}
                         for t in r["conversations"]]} for r in kit.SHAREGPT]
    data = kit.write_jsonl(tmp_path / "s.jsonl", renamed)
    prefix = str(tmp_path / "share")
    keys = {"messages": "chat", "tags": {"role_tag": "who", "content_tag": "text", "user_tag": "u",
                                         "assistant_tag": "a", "system_tag": "s"}}
    _run(tok_dir, data, prefix, "--handler-name", "SharegptStyleInstructionHandler", "--prompt-type", "tokenizer",
         "--map-keys", json.dumps(keys))
    (ids, labels), _ = _instruction(prefix)
    im = lambda role, text: f"<|im_start|>{role}\n{text}<|im_end|>\n"
    first = tok.encode(im("system", "be short") + im("user", "say hello") + "<|im_start|>assistant\n")
    second = tok.encode(im("user", "name a colour") + "<|im_start|>assistant\n")
    replies = [tok.encode("hello<|im_end|>\n"), tok.encode("blue<|im_end|>\n")]
    assert ids.tolist() == first + replies[0] + second + replies[1]
    assert labels.tolist() == [IGNORE_INDEX] * len(first) + replies[0] + [IGNORE_INDEX] * len(second) + replies[1]


TOOLS = [{"name": "get_colour", "description": "the colour of a thing",
          "parameters": {"type": "object", "properties": {"thing": {"type": "string", "description": "what"}},
                         "required": ["thing"]}}]
CALL = {"name": "get_colour", "arguments": {"thing": "sky"}}
# what the qwen template must make of TOOLS: the system prompt, then the tool described (written out here)
TOOLS_SYSTEM = ("You are a helpful assistant.\nTools you may call:\n- get_colour: the colour of a thing\n"
                "  thing (string, required): what\nTo call a tool, answer with\n"
                "Action: the tool name (one of get_colour)\nAction Input: its arguments as a JSON object\n")


def test_sharegpt_tool_turns_learn_the_call_and_mask_the_tool_result(tmp_path, capsys):
    """function_call replies are learned like gpt ones, observation turns masked like human ones
    (qwen renders them as tool turns); `tools` are described after the system prompt; an unknown
    role is refused in one line naming the record."""
    from mindspeed.data.__main__ import main
    from mindspeed.data.tokenizer import HuggingFaceTokenizer
    call_text = 'Action: get_colour\nAction Input: {"thing": "sky"}'
    tok_dir = kit.make_tokenizer(str(tmp_path / "tok"), extra_texts=[TOOLS_SYSTEM, call_text, "tool sky"])
    tok = HuggingFaceTokenizer(tok_dir)
    record = {"conversations": [{"from": "human", "value": "what is red"},
                                {"from": "function_call", "value": json.dumps(CALL)},
                                {"from": "observation", "value": "blue"},
                                {"from": "gpt", "value": "blue is a colour"}], "tools": json.dumps(TOOLS)}
    prefix = str(tmp_path / "tools")
    _run(tok_dir, kit.write_jsonl(tmp_path / "s.jsonl", [record]), prefix,
         "--handler-name", "SharegptStyleInstructionHandler", "--prompt-type", "qwen")
    (ids, labels), = _instruction(prefix)
    end = [tok.token_id("<|im_end|>")]
    im = lambda role, text: f"<|im_start|>{role}\n{text}<|im_end|>\n"
    turns = [(tok.encode(im("system", TOOLS_SYSTEM) + im("user", "what is red") + "<|im_start|>assistant\n"),
              tok.encode(call_text) + end),
             (tok.encode("\n" + im("tool", "blue") + "<|im_start|>assistant\n"), tok.encode("blue is a colour") + end)]
    assert ids.tolist() == [t for prompt, reply in turns for t in prompt + reply]
    assert labels.tolist() == [t for prompt, reply in turns for t in [IGNORE_INDEX] * len(prompt) + reply]
    assert kit.SPECIALS.index("<unk>") not in ids        # every word known: a wrong text shows
    bad = dict(record, conversations=record["conversations"][:1] + [{"from": "bot", "value": "x"}])
    for rows, message in (([record, bad], "s.jsonl:2: turn 1 has role 'bot'"),
                          ([dict(record, tools="[{")], "s.jsonl:1: field 'tools' is not valid JSON")):
        rc = main(["--input", kit.write_jsonl(tmp_path / "s.jsonl", rows), "--tokenizer-name-or-path", tok_dir,
                   "--output-prefix", str(tmp_path / "bad"), "--handler-name", "SharegptStyleInstructionHandler",
                   "--prompt-type", "qwen"])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and err.count("\n") == 1, err


def test_pretrain_handler_reads_parquet_json_csv_arrow_and_text_with_several_keys(tok_dir, tok, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"text": "say hello", "title": "the cat"}, {"text": "blue is a colour", "title": "red"}]
    os.makedirs(tmp_path / "in")
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "in" / "a.parquet"))
    (tmp_path / "in" / "b.json").write_text(json.dumps(rows[::-1]))            # a JSON array
    prefix = str(tmp_path / "pre")
    _run(tok_dir, str(tmp_path / "in"), prefix, "--json-keys", "text", "title", "--append-eod")
    for key in ("text", "title"):
        expected = [tok.encode(r[key]) + [tok.eod] for r in rows + rows[::-1]]
        assert [d.tolist() for d in _docs(f"{prefix}_{key}_document")] == expected
    os.makedirs(tmp_path / "hf")                 # a CSV with a header, an Arrow stream as `datasets` caches it
    (tmp_path / "hf" / "a.csv").write_text('text,title\n"say hello","the cat"\n')
    with pa.OSFile(str(tmp_path / "hf" / "b.arrow"), "wb") as sink:
        table = pa.Table.from_pylist(rows[1:])
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    _run(tok_dir, str(tmp_path / "hf"), str(tmp_path / "hf_out"), "--json-keys", "text", "title")
    for key in ("text", "title"):
        assert [d.tolist() for d in _docs(str(tmp_path / f"hf_out_{key}_document"))] == [tok.encode(r[key]) for r in rows]
    (tmp_path / "bad.csv").write_text("text\nok\none,two\n")
    from mindspeed.data.__main__ import main
    capsys.readouterr()
    rc = main(["--input", str(tmp_path / "bad.csv"), "--tokenizer-name-or-path", tok_dir,
               "--output-prefix", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "bad.csv:3: 1 more values than the header's 1 fields" in err, err
    (tmp_path / "c.txt").write_text("say hello\n\nthe cat\n")                   # one record per line
    _run(tok_dir, str(tmp_path / "*.txt"), str(tmp_path / "txt"))
    assert [d.tolist() for d in _docs(str(tmp_path / "txt_text_document"))] == [tok.encode("say hello"),
                                                                                tok.encode("the cat")]


def test_pack_fills_fixed_length_samples_and_keeps_every_reply(tok_dir, tmp_path):
    data = kit.write_jsonl(tmp_path / "a.jsonl", kit.ALPACA * 3)
    plain, packed = str(tmp_path / "plain"), str(tmp_path / "packed")
    flags = ("--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "chatml")
    _run(tok_dir, data, plain, *flags)
    _run(tok_dir, data, packed, *flags, "--pack", "--seq-length", "48")
    samples, packs = _instruction(plain), _instruction(packed)
    assert all(len(ids) == 48 for ids, _ in packs) and len(packs) < len(samples)
    reply_tokens = lambda pairs: sorted(int(x) for _, labels in pairs for x in labels if x != IGNORE_INDEX)
    assert reply_tokens(packs) == reply_tokens(samples)         # nothing lost, padding carries no label
    _run(tok_dir, data, str(tmp_path / "pad8"), *flags, "--pad-to-multiple-of", "8")
    padded = _instruction(str(tmp_path / "pad8"))
    assert all(len(ids) % 8 == 0 and len(ids) - len(s) < 8 for (ids, _), (s, _) in zip(padded, samples))
    assert reply_tokens(padded) == reply_tokens(samples)
    longest = max(len(ids) for ids, _ in samples)
    _run(tok_dir, data, str(tmp_path / "cut"), *flags, "--seq-length", str(longest - 1))
    assert all(len(ids) < longest for ids, _ in _instruction(str(tmp_path / "cut")))   # longer ones dropped


def test_neat_pack_no_token_predicts_across_a_sample_boundary(tok_dir, tmp_path):
    """With an empty prompt (template empty) every token is learned: in a neat-packed sample the
    last token of one conversation still must not predict the first of the next."""
    from mindspeed.data.instruction_samples import build_splits
    records = [{"instruction": "", "input": "", "output": "blue is a colour"}] * 3
    prefix = str(tmp_path / "neat")
    _run(tok_dir, kit.write_jsonl(tmp_path / "a.jsonl", records), prefix, "--handler-name",
         "AlpacaStyleInstructionHandler", "--prompt-type", "empty", "--pack", "--neat-pack", "--seq-length", "16")
    train, _ = build_splits(prefix, "100,0,0", 16, 1, 0, neat_pack=True)
    example = train.example(0)
    assert example["segments"].tolist() == [1] * 4 + [2] * 4 + [3] * 4 + [0] * 4
    assert example["loss_mask"].tolist() == ([1.0] * 3 + [0.0]) * 3 + [0.0] * 4   # 3 predictions per sample


def test_workers_and_subsets_give_the_same_files(tok_dir, tmp_path):
    from mindspeed.data.workers import ordered_map
    assert list(ordered_map(lambda x: (x, os.getpid()), range(40), 2, chunksize=4))[0][1] != os.getpid()
    data = kit.write_jsonl(tmp_path / "a.jsonl", kit.ALPACA * 20)
    flags = ("--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "llama2")
    outs = []
    for i, extra in enumerate([(), ("--workers", "2"), ("--workers", "2", "--n-subs", "3")]):
        outs.append(str(tmp_path / f"o{i}"))
        _run(tok_dir, data, outs[-1], *flags, *extra)
    for key in ("input_ids", "labels", "attention_mask"):
        for ext in (".bin", ".idx"):
            first = f"{outs[0]}_packed_{key}_document{ext}"
            assert all(filecmp.cmp(first, f"{o}_packed_{key}_document{ext}", shallow=False) for o in outs[1:])
    assert not glob.glob(str(tmp_path / "*.tmp*")) and not glob.glob(str(tmp_path / "*sub0*"))


def test_cache_dir_reuses_an_identical_run_and_progress_is_logged(tok_dir, tmp_path, capsys):
    from mindspeed.data.__main__ import main
    data = kit.write_jsonl(tmp_path / "a.jsonl", kit.ALPACA)
    argv = ["--input", data, "--tokenizer-name-or-path", tok_dir, "--handler-name", "AlpacaStyleInstructionHandler",
            "--prompt-type", "llama2", "--cache-dir", str(tmp_path / "cache"), "--log-interval", "2"]
    assert main(argv + ["--output-prefix", str(tmp_path / "first")]) == 0
    out = capsys.readouterr().out
    assert "processed 2 records" in out and "processed 6 records" in out
    assert main(argv + ["--output-prefix", str(tmp_path / "second")]) == 0
    assert "reused the cached result" in capsys.readouterr().out
    assert filecmp.cmp(str(tmp_path / "first_packed_labels_document.bin"),
                       str(tmp_path / "second_packed_labels_document.bin"), shallow=False)
    assert main(argv + ["--output-prefix", str(tmp_path / "third"), "--overwrite-cache"]) == 0
    assert "reused" not in capsys.readouterr().out


REFUSALS = [
    (["--handler-name", "NoSuchHandler"], "unknown --handler-name 'NoSuchHandler'"),
    (["--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "vicuna"], "unknown --prompt-type 'vicuna'"),
    (["--handler-name", "AlpacaStyleInstructionHandler"], "instruction handlers need --prompt-type"),
    (["--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "llama2", "--map-keys", "{prompt:"],
     "--map-keys is not valid JSON"),
    (["--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "llama2", "--map-keys", '{"prompt":"ask"}'],
     "a.jsonl:1: no 'ask' field"),
    (["--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "llama2", "--map-keys", '{"answer":"x"}'],
     "'answer' is not a key of AlpacaStyleInstructionHandler"),
    (["--handler-name", "SharegptStyleInstructionHandler", "--prompt-type", "llama2"], "a.jsonl:1: no 'conversations'"),
    (["--json-keys", "body"], "a.jsonl:1: no 'body' field"),
    (["--pack"], "--pack shape instruction samples"),
    (["--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "chatml", "--pack"], "--pack needs --seq-length"),
    (["--workers", "0"], "--workers must be a positive integer"),
    (["--workers", "two"], "argument --workers: invalid int value: 'two'"),
    (["--neat-pak"], "unknown flag --neat-pak"),
    (["--promt-type", "qwen"], "unknown flag --promt-type (did you mean --prompt-type?)"),
]


@pytest.mark.parametrize("flags, message", REFUSALS, ids=[m[:30] for _, m in REFUSALS])
def test_bad_input_is_refused_in_one_line_and_nothing_is_written(tok_dir, tmp_path, capsys, flags, message):
    from mindspeed.data.__main__ import main
    data = kit.write_jsonl(tmp_path / "a.jsonl", kit.ALPACA)
    rc = main(["--input", data, "--tokenizer-name-or-path", tok_dir, "--output-prefix", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl"]


def test_missing_tokenizer_empty_input_and_a_bad_late_record(tok_dir, tmp_path, capsys):
    from mindspeed.data.__main__ import main
    data = kit.write_jsonl(tmp_path / "a.jsonl", kit.ALPACA + [{"instruction": "x"}])   # no output, last line
    (tmp_path / "empty.jsonl").write_text("")
    base = ["--output-prefix", str(tmp_path / "o"), "--handler-name", "AlpacaStyleInstructionHandler",
            "--prompt-type", "llama2"]
    cases = [(["--input", data, "--tokenizer-name-or-path", str(tmp_path / "nope")], "is not a directory"),
             (["--input", str(tmp_path / "empty.jsonl"), "--tokenizer-name-or-path", tok_dir], "no documents"),
             (["--input", data, "--tokenizer-name-or-path", tok_dir], "a.jsonl:7: no 'output' field")]
    for argv, message in cases:
        assert main(argv + base) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "empty.jsonl"]        # no output, no temporary file
    no_template = kit.make_tokenizer(str(tmp_path / "plain_tok"), chat_template=False)
    assert main(["--input", data, "--tokenizer-name-or-path", no_template, "--output-prefix", str(tmp_path / "o"),
                 "--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "tokenizer"]) == 2
    assert "has no chat_template" in capsys.readouterr().err
