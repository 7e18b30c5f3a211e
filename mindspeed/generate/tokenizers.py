"""--tokenizer-model TOK: a Hugging Face tokenizer directory (or its tokenizer.json, read from its
directory), or the `PREFIX.tokenizer.json` that `python -m mindspeed.data` writes beside a dataset
(the character-level tokenizer, or the name of the Hugging Face one it used)."""
from __future__ import annotations

import json
import os

from mindspeed.data.tokenizer import HuggingFaceTokenizer, TokenizerError, from_json
from mindspeed.errors import InferenceError


def load(path: str):
    """The tokenizer TOK names; InferenceError (one line) for anything else."""
    try:
        if os.path.isdir(path):
            return HuggingFaceTokenizer(path)
        if not os.path.isfile(path):
            raise InferenceError(f"--tokenizer-model {path} does not exist (give a Hugging Face tokenizer "
                                 "directory or a PREFIX.tokenizer.json written by `python -m mindspeed.data`)")
        desc = _read_json(path)
        if isinstance(desc, dict) and "type" in desc and "model" not in desc:
            return from_json(desc)           # written by python -m mindspeed.data
        if isinstance(desc, dict) and "model" in desc:   # a Hugging Face tokenizer.json: its directory's files
            return HuggingFaceTokenizer(os.path.dirname(os.path.abspath(path)))
    except TokenizerError as err:
        raise InferenceError(str(err)) from None
    raise InferenceError(f"--tokenizer-model {path} is not a tokenizer file this knows: give a Hugging Face "
                         "tokenizer directory (or its tokenizer.json) or a PREFIX.tokenizer.json written by "
                         "`python -m mindspeed.data`")


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def encode(tokenizer, text: str) -> list[int]:
    return [int(i) for i in tokenizer.tokenize(text)]


def chat_prompt(tokenizer, history: list[dict], message: str) -> str:
    """The text of the next chat turn: the tokenizer's chat template where it has one, else the
    conversation so far as plain text followed by the new message (a base model continues it)."""
    messages = history + [{"role": "user", "content": message}]
    if getattr(tokenizer, "has_chat_template", lambda: False)():
        return tokenizer.render_chat(messages, add_generation_prompt=True)
    return "".join(m["content"] for m in messages)
