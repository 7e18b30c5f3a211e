"""Megatron tokenizers that the flags describe completely: GPT2BPETokenizer (--vocab-file,
--merge-file) and NullTokenizer (--vocab-size).

Pretraining reads already-tokenized indexed datasets, so a trainer needs only what Megatron's
tokenizers report to it: the vocabulary size and the end-of-document id (plus the identifiers
GPTDataset hashes into its cache names). Those are read here from the same files and sizes
Megatron-LM uses, with its numbers: GPT-2's vocab.json size and its <|endoftext|> id; NullTokenizer
N -> N + 1 ids, the last one the end of a document. Text is never encoded here; datasets are made
with Megatron's tools/preprocess_data.py or `python -m mindspeed.data`.
"""
from __future__ import annotations

import json
import os

from mindspeed.data.tokenizer import HuggingFaceTokenizer, TokenizerError, load_tokenizer, tokenizer_path
from mindspeed.megatron_defaults import padded_vocab_size

GPT2_EOD = "<|endoftext|>"


class _ReadVocabulary:
    """A tokenizer read for what a trainer needs of it: its vocabulary size and end-of-document id."""
    _size: int
    _eod: int

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def eod(self) -> int:
        return self._eod


class GPT2VocabTokenizer(_ReadVocabulary):
    kind = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        try:
            with open(vocab_file, encoding="utf-8") as f:
                encoder = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise TokenizerError(f"--vocab-file {vocab_file!r} is not a readable GPT-2 vocab.json: {err}") from err
        if not isinstance(encoder, dict) or GPT2_EOD not in encoder:
            raise TokenizerError(f"--vocab-file {vocab_file!r} is not a GPT-2 vocab.json (no {GPT2_EOD} entry)")
        _check_merges(merge_file)
        self._size, self._eod = len(encoder), int(encoder[GPT2_EOD])
        self.unique_identifiers = {"class": self.kind, "vocab_file": os.path.abspath(vocab_file),
                                   "merge_file": os.path.abspath(merge_file)}


def _check_merges(merge_file: str) -> None:
    """A GPT-2 merges.txt: an optional '#version' line, then one 'left right' pair per line."""
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = [line for line in f.read().split("\n") if line and not line.startswith("#version")]
    except (OSError, UnicodeDecodeError) as err:
        raise TokenizerError(f"--merge-file {merge_file!r} is unreadable: {err}") from err
    bad = next((line for line in lines if len(line.split()) != 2), None)
    if not lines or bad is not None:
        raise TokenizerError(f"--merge-file {merge_file!r} is not a GPT-2 merges.txt "
                             f"({'empty' if not lines else f'line {bad[:40]!r}'})")


class NullTokenizer:
    kind = "NullTokenizer"

    def __init__(self, vocab_size: int):
        self._size = int(vocab_size)
        self.unique_identifiers = {"class": self.kind, "vocab_size": self._size}

    @property
    def vocab_size(self) -> int:
        return self._size + 1

    @property
    def eod(self) -> int:
        return self._size


class SentencePieceModelTokenizer(_ReadVocabulary):
    """Megatron's Llama2Tokenizer (--tokenizer-model FILE: a SentencePiece tokenizer.model, as
    MindSpeed-LLM 2.1.0's Mixtral recipe passes): its vocabulary and end-of-sequence id, as Megatron's
    _Llama2Tokenizer reports them (SentencePiece's piece count and eos id)."""
    kind = "Llama2Tokenizer"

    def __init__(self, model_file: str):
        try:
            import sentencepiece
        except ImportError as err:
            raise TokenizerError("--tokenizer-type Llama2Tokenizer reads a SentencePiece model: pip install "
                                 "sentencepiece (in MindSpeed's `data` extra)") from err
        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.Load(model_file)
        except (OSError, RuntimeError) as err:
            raise TokenizerError(f"--tokenizer-model {model_file!r} is not a SentencePiece model: "
                                 f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
        if processor.eos_id() < 0:
            raise TokenizerError(f"--tokenizer-model {model_file!r} has no end-of-sequence piece (Llama2Tokenizer "
                                 "ends documents with it)")
        self._size, self._eod = processor.vocab_size(), processor.eos_id()
        self.unique_identifiers = {"class": self.kind, "tokenizer_model": os.path.abspath(model_file)}


def from_flags(args):
    """The tokenizer the flags describe, or None: the trainer then uses the one saved beside the
    dataset (or the HuggingFace one --tokenizer-model names)."""
    if args.tokenizer_type == GPT2VocabTokenizer.kind:
        return GPT2VocabTokenizer(args.vocab_file, args.merge_file)
    if args.tokenizer_type == NullTokenizer.kind:
        return NullTokenizer(args.vocab_size)
    if args.tokenizer_type == SentencePieceModelTokenizer.kind:
        return SentencePieceModelTokenizer(args.tokenizer_model)
    return None


def named_tokenizer(args):
    """The tokenizer the flags name, Hugging Face's (--tokenizer-model, offline) included, or None:
    the one saved beside the dataset then applies."""
    if args.tokenizer_type == HuggingFaceTokenizer.kind:
        return load_tokenizer("", args.tokenizer_type, args.tokenizer_model)
    return from_flags(args)


def model_vocab_size(args, vocab_size: int, tp: int) -> int:
    """The embedding's and output layer's rows (args.padded_vocab_size, set by both trainers):
    --padded-vocab-size N as given (MindSpeed-LLM's override of Megatron's padding; TP divides it,
    checked with the flags), else the tokenizer's vocabulary padded to a multiple of
    --make-vocab-size-divisible-by x TP, as Megatron pads it."""
    given = args.padded_vocab_size
    if given is None:
        return padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, tp)
    if given < vocab_size:
        raise TokenizerError(f"--padded-vocab-size {given} is smaller than the tokenizer's vocabulary ({vocab_size} "
                             f"tokens): give at least {vocab_size}, or drop it to pad the vocabulary as Megatron does")
    return given


def check_dataset_tokenizer(prefix: str, tokenizer) -> None:
    """A dataset made by `python -m mindspeed.data` names its tokenizer; it must be this one."""
    path = tokenizer_path(prefix)
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            kind = json.load(f).get("type")
    except (OSError, json.JSONDecodeError, AttributeError):
        return                       # unreadable descriptions are data.resolve_data's to report
    if kind != tokenizer.kind:
        raise TokenizerError(f"--tokenizer-type {tokenizer.kind} but the dataset {prefix!r} was tokenized "
                             f"with {kind} ({path})")
