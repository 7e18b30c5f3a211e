"""Tokenizers for preprocessing and training, saved next to the dataset so both use one vocab.

CharLevelTokenizer is built from the corpus itself (no download). HuggingFaceTokenizer wraps
`transformers.AutoTokenizer` with local_files_only=True: it is used only when the user names one
that is already available offline.

Both expose what Megatron-Core's GPTDataset reads (vocab_size, eod, unique_identifiers) and a
small JSON description (`to_json`) written as `<prefix>.tokenizer.json` beside `<prefix>.bin/.idx`.
"""
from __future__ import annotations

import json
import os
from typing import Iterable

import numpy as np

from mindspeed.files import atomic_write

EOD, UNK = "<eod>", "<unk>"


class TokenizerError(ValueError):
    pass


def tokenizer_path(prefix: str) -> str:
    return prefix + ".tokenizer.json"


class CharLevelTokenizer:
    """One id per character; id 0 is end-of-document, id 1 unknown characters."""

    kind = "CharLevel"

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise TokenizerError("character vocabulary has duplicates")
        self.chars = chars
        self._id_of = {c: i + 2 for i, c in enumerate(chars)}
        self.unique_identifiers = {"class": "CharLevelTokenizer", "chars": chars}

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> "CharLevelTokenizer":
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        return cls("".join(sorted(seen)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 2

    @property
    def eod(self) -> int:
        return 0

    @property
    def unk(self) -> int:
        return 1

    def tokenize(self, text: str) -> np.ndarray:
        # ord-indexed lookup table: vectorised instead of a per-character dict lookup
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        if codes.size == 0:
            return np.zeros(0, dtype=np.int64)
        table = np.full(int(codes.max()) + 1, self.unk, dtype=np.int64)
        for c, i in self._id_of.items():
            if ord(c) < table.size:
                table[ord(c)] = i
        return table[codes]

    def detokenize(self, ids) -> str:
        special = {0: EOD, 1: UNK}
        return "".join(special.get(int(i)) or self.chars[int(i) - 2] for i in ids)

    def to_json(self) -> dict:
        return {"type": self.kind, "chars": self.chars}


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer that is already on this machine (never downloads)."""

    kind = "HuggingFaceTokenizer"

    def __init__(self, name_or_path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise TokenizerError(f"HuggingFaceTokenizer {name_or_path!r} needs the 'transformers' "
                                 "package (pip install transformers); or use the built-in "
                                 "CharLevel tokenizer") from err
        try:
            self._tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        except Exception as err:  # transformers raises OSError/ValueError variants
            raise TokenizerError(f"Hugging Face tokenizer {name_or_path!r} is not available offline "
                                 f"({type(err).__name__}: {err})") from err
        self.name = name_or_path
        eod = self._tok.eos_token_id
        self._eod = eod if eod is not None else self._tok.sep_token_id
        if self._eod is None:
            raise TokenizerError(f"tokenizer {name_or_path!r} has no eos/sep token to end documents")
        self.unique_identifiers = {"class": "HuggingFaceTokenizer", "name": name_or_path}

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> np.ndarray:
        return np.asarray(self._tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    # what chat templates and instruction handlers need (mindspeed.data.templates)
    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def token_id(self, token: str) -> int | None:
        """The id of `token` when the vocabulary has it as one token, else None."""
        ids = self._tok.convert_tokens_to_ids([token])
        unk = self._tok.unk_token_id
        return ids[0] if ids and ids[0] is not None and (ids[0] != unk or token == self._tok.unk_token) else None

    @property
    def bos_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def eos_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def pad_id(self) -> int:
        """Padding of packed samples: the tokenizer's pad token, else its eos (always masked)."""
        return self._tok.pad_token_id if self._tok.pad_token_id is not None else self._eod

    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def to_json(self) -> dict:
        return {"type": self.kind, "name": self.name}


def from_json(desc: dict):
    kind = desc.get("type")
    if kind == CharLevelTokenizer.kind:
        return CharLevelTokenizer(desc["chars"])
    if kind == HuggingFaceTokenizer.kind:
        return HuggingFaceTokenizer(desc["name"])
    raise TokenizerError(f"unknown tokenizer type {kind!r} (expected CharLevel or HuggingFaceTokenizer)")


def save_tokenizer(tokenizer, prefix: str) -> str:
    path = tokenizer_path(prefix)
    atomic_write(path, lambda tmp: _dump_json(tokenizer.to_json(), tmp))
    return path


def _dump_json(data: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)


def load_tokenizer(prefix: str, tokenizer_type: str | None = None, tokenizer_model: str | None = None):
    """The tokenizer saved beside `prefix`, or the one the flags name (HF needs a model name)."""
    if tokenizer_type == HuggingFaceTokenizer.kind:
        if not tokenizer_model:
            raise TokenizerError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model")
        return HuggingFaceTokenizer(tokenizer_model)
    path = tokenizer_path(prefix)
    if not os.path.isfile(path):
        raise TokenizerError(f"no tokenizer file {path!r} next to the dataset; preprocess the data with "
                             "`python -m mindspeed.data` (it writes one), or pass "
                             "--tokenizer-type HuggingFaceTokenizer --tokenizer-model NAME")
    try:
        with open(path, encoding="utf-8") as f:
            desc = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise TokenizerError(f"tokenizer file {path!r} is unreadable or corrupt: {err}") from err
    tok = from_json(desc)
    if tokenizer_type is not None and tok.kind != tokenizer_type:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} but the dataset {prefix!r} was "
                             f"tokenized with {tok.kind}")
    return tok
