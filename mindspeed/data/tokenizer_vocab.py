"""The vocabulary size of a Hugging Face tokenizer.json, as `len(tokenizer)` counts it (the model's
tokens plus added tokens), read from the JSON alone (no tokenizer library needed).

Hugging Face configs often have more embedding rows than the tokenizer has tokens (Qwen2: 151936
rows, 151665 tokens). The trainer pads *its tokenizer's* size, so with --tokenizer-model the
converter keeps only the tokenizer's rows and pads those the way the trainer does."""
from __future__ import annotations

import json
import os

from mindspeed.errors import ConvertError


def tokenizer_vocab_size(path: str) -> int:
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not path.endswith(".json"):
        raise ConvertError(f"--tokenizer-model {path}: give the tokenizer.json (its vocabulary size is read "
                           "from it); other tokenizer files are not read")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        vocab = data["model"]["vocab"]
        ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))   # BPE/WordLevel | Unigram
        ids.update(int(token["id"]) for token in data.get("added_tokens") or [])
    except FileNotFoundError:
        raise ConvertError(f"--tokenizer-model {path} does not exist") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConvertError(f"--tokenizer-model {path} is not a Hugging Face tokenizer.json "
                           f"({type(err).__name__}: {err})") from None
    if not ids:
        raise ConvertError(f"--tokenizer-model {path} has an empty vocabulary")
    return len(ids)
