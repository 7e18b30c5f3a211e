"""Character-level mode of `python -m mindspeed.data`: text / JSONL -> one Megatron indexed dataset,
with the tokenizer saved beside it (the MindSpeed-LLM-style handlers are pipeline.py).

Inputs: plain-text files (one document each, or one per blank-line-separated block with
--split-on-blank-lines), directories of them, or JSONL files (one document per line, text under
--json-key). Each document ends with the end-of-document token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from mindspeed.data.errors import DataError
from mindspeed.data.indexed import write_dataset
from mindspeed.data.records import expand_inputs, read_records
from mindspeed.data.tokenizer import CharLevelTokenizer, HuggingFaceTokenizer, save_tokenizer


@dataclass
class PreprocessConfig:
    inputs: Sequence[str]
    output_prefix: str
    tokenizer_type: str = "CharLevel"
    tokenizer_model: str | None = None
    json_key: str = "text"
    chunk_chars: int = 0          # >0: cut long documents into pieces of about this many chars
    append_eod: bool = True


def _read_text(path: str) -> str:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")   # old Gutenberg texts; every byte maps to one character


def _jsonl_documents(path: str, key: str) -> Iterator[str]:
    for origin, record in read_records(path):
        if key not in record:
            raise DataError(f"{origin}: no {key!r} field (choose it with --json-key)")
        yield str(record[key])


def _chunks(text: str, size: int) -> Iterator[str]:
    """Cut at the last blank line before `size` chars, so pieces keep whole speeches."""
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            cut = text.rfind("\n\n", start + size // 2, end)
            end = cut + 2 if cut != -1 else end
        yield text[start:end]
        start = end


def read_documents(files: Sequence[str], json_key: str = "text", chunk_chars: int = 0) -> Iterator[str]:
    for path in files:
        docs = _jsonl_documents(path, json_key) if path.endswith((".json", ".jsonl")) else [_read_text(path)]
        for doc in docs:
            yield from (_chunks(doc, chunk_chars) if chunk_chars > 0 else [doc])


def preprocess(cfg: PreprocessConfig, log=print) -> dict:
    files = expand_inputs(cfg.inputs)
    if cfg.tokenizer_type == "CharLevel":
        texts = list(read_documents(files, cfg.json_key, cfg.chunk_chars))
        tokenizer = CharLevelTokenizer.from_texts(texts)
    elif cfg.tokenizer_type == "HuggingFaceTokenizer":
        if not cfg.tokenizer_model:
            raise DataError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model NAME_OR_PATH")
        tokenizer = HuggingFaceTokenizer(cfg.tokenizer_model)
        texts = read_documents(files, cfg.json_key, cfg.chunk_chars)
    else:
        raise DataError(f"unknown --tokenizer-type {cfg.tokenizer_type!r}")

    def encoded():
        for text in texts:
            if not text:
                continue          # an empty document: an end-of-document token alone is no document
            ids = tokenizer.tokenize(text)
            yield np.append(ids, tokenizer.eod) if cfg.append_eod else ids

    stats = write_dataset(cfg.output_prefix, encoded(), tokenizer.vocab_size)
    save_tokenizer(tokenizer, cfg.output_prefix)
    stats.update(files=len(files), vocab_size=tokenizer.vocab_size, tokenizer=tokenizer.kind,
                 prefix=cfg.output_prefix)
    log(f"> wrote {stats['prefix']}.bin/.idx: {stats['documents']} documents, {stats['tokens']} tokens "
        f"({stats['dtype']}), {stats['tokenizer']} vocab {stats['vocab_size']}, from {stats['files']} files")
    return stats
