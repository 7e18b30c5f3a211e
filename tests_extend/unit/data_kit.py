"""A tiny Hugging Face tokenizer folder and instruction data, built locally (no download), for the
preprocessing and fine-tuning tests. The tokenizer is word level over exactly the words used here
(templates included), so every template piece maps to known ids and a wrong piece shows."""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATE_WORDS = ("[INST] [/INST] <<SYS>> <</SYS>> Human: Assistant: ### Instruction: Response: Below is an "
                  "instruction that describes a task. Write a response appropriately completes the request. "
                  "You are a helpful assistant. system user assistant")

ALPACA = [
    {"instruction": "name a colour", "input": "", "output": "blue is a colour"},
    {"instruction": "add the numbers", "input": "two and three", "output": "five"},
    {"instruction": "say hello", "input": "to the cat", "output": "hello cat"},
    {"instruction": "name an animal", "input": "", "output": "the cat is an animal"},
    {"instruction": "count to three", "input": "", "output": "one two three"},
    {"instruction": "what is red", "input": "", "output": "red is a colour"},
]
SHAREGPT = [
    {"conversations": [{"from": "system", "value": "be short"},
                       {"from": "human", "value": "say hello"}, {"from": "gpt", "value": "hello"},
                       {"from": "human", "value": "name a colour"}, {"from": "gpt", "value": "blue"}]},
    {"conversations": [{"from": "human", "value": "count to three"}, {"from": "gpt", "value": "one two three"}]},
]


def _words(extra_texts=()) -> list[str]:
    from tokenizers.pre_tokenizers import Whitespace
    texts = [TEMPLATE_WORDS, "be short blue hello", *extra_texts]
    texts += [v for rec in ALPACA for v in rec.values()]
    seen: dict[str, None] = {}
    for text in texts:
        for piece, _ in Whitespace().pre_tokenize_str(text):
            seen.setdefault(piece, None)
    return list(seen)


def make_tokenizer(out_dir: str, chat_template: bool = True, extra_texts=()) -> str:
    """A PreTrainedTokenizerFast folder: word level, bos <s>, eos </s>, pad <pad>, the ChatML tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {tok: i for i, tok in enumerate(SPECIALS + _words(extra_texts))}    # extra_texts: more words
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return out_dir


def write_jsonl(path: str, records: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def preprocess(*argv: str) -> int:
    """`python -m mindspeed.data` in this process (quiet)."""
    import contextlib
    import io
    from mindspeed.data.__main__ import main
    with contextlib.redirect_stdout(io.StringIO()):
        return main(list(argv))
