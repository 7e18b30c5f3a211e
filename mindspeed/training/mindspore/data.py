"""The MindSpore trainer's batches from Megatron indexed datasets (read by mindspeed.data.indexed_reader).

Documents are split into train/valid/test by --split (contiguous document ranges, as Megatron
does); each split's tokens form one stream cut into samples of seq_length+1 tokens, visited in a
seeded random order per epoch. Global batch k is samples [k*gbs, (k+1)*gbs); data-parallel rank r
takes micro-batch slice r of it (Megatron's pretraining sampler order).
"""
from __future__ import annotations

import json
import os

import numpy as np

from mindspeed.data.errors import DataError
from mindspeed.data.indexed_reader import IndexedTokens, split_bounds
from mindspeed.data.instruction_samples import build_splits
from mindspeed.data.shakespeare import ensure_dataset
from mindspeed.data.tokenizer import CharLevelTokenizer, load_tokenizer


def vocab_size_of(prefix: str, args) -> int:
    """Vocabulary size from the tokenizer file beside the dataset (or --vocab-size)."""
    if getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    path = prefix + ".tokenizer.json"
    if not os.path.isfile(path):
        raise DataError(f"no tokenizer file {path!r} next to the dataset (pass --vocab-size or preprocess "
                        "with `python -m mindspeed.data`)")
    with open(path, encoding="utf-8") as f:
        desc = json.load(f)
    if desc.get("type") == "CharLevel":
        return len(desc["chars"]) + 2
    return int(load_tokenizer(prefix).vocab_size)


class SampleStream:
    """Samples of seq_length+1 tokens from one split, in a seeded order, endlessly."""

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int, name: str):
        self.tokens, self.seq_length, self.seed = tokens, seq_length, seed
        self.num_samples = (len(tokens) - 1) // seq_length if len(tokens) > 1 else 0
        if self.num_samples == 0:
            raise DataError(f"the {name} split has {len(tokens)} tokens, fewer than one sample of "
                            f"{seq_length + 1}; use more data, a shorter --seq-length or another --split")
        self._orders = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.RandomState(self.seed + epoch).permutation(self.num_samples)}
        return self._orders[epoch]

    def sample(self, index: int) -> np.ndarray:
        epoch, pos = divmod(index, self.num_samples)
        start = int(self._order(epoch)[pos]) * self.seq_length
        return self.tokens[start:start + self.seq_length + 1]

    def example(self, index: int) -> dict:
        row = self.sample(index)
        return {"tokens": row[:-1], "labels": row[1:], "loss_mask": np.ones(self.seq_length, np.float32)}


def micro_batch(stream, first_sample: int, mbs: int, eod_rules=None) -> dict:
    """`mbs` consecutive examples of a stream (SampleStream, or instruction_samples.InstructionSamples);
    eod_rules (eod.EodRules): the loss mask, positions and attention mask of packed documents."""
    examples = [stream.example(first_sample + i) for i in range(mbs)]
    tokens, labels, loss_mask = (np.stack([e[k] for e in examples]) for k in ("tokens", "labels", "loss_mask"))
    batch = {"tokens": tokens.astype(np.int32), "labels": labels.astype(np.int32),
             "loss_mask": loss_mask.astype(np.float32)}
    return batch if eod_rules is None else eod_rules.apply(batch)


def micro_batches_for_step(stream, consumed: int, args, dp_rank: int, dp_size: int, eod_rules=None) -> list:
    """This rank's micro-batches of the global batch starting at sample `consumed`."""
    mbs, per_step = args.micro_batch_size, args.micro_batch_size * dp_size
    n_micro = args.global_batch_size // per_step
    return [micro_batch(stream, consumed + m * per_step + dp_rank * mbs, mbs, eod_rules) for m in range(n_micro)]


def eod_id(args, flag_tokenizer=None) -> int:
    """The end-of-document token id, where the torch trainer takes it: the tokenizer the flags
    name, mock data's character tokenizer, else the one saved beside the dataset."""
    if flag_tokenizer is not None:
        return int(flag_tokenizer.eod)
    if args.mock_data:
        import string
        return CharLevelTokenizer(string.printable).eod     # the torch trainer's mock tokenizer
    return int(load_tokenizer(dataset_prefix(args)).eod)


def dataset_prefix(args, log=print) -> str:
    """The one dataset prefix --data-path names (the bundled Shakespeare dataset without one)."""
    paths = list(args.data_path or [])
    if not paths:
        paths = [ensure_dataset(log=log)]
    if len(paths) != 1:   # blends are refused by the support matrix (data-blend); a lone weight is not
        raise DataError(f"--data-path {' '.join(paths)}: the mindspore trainer reads one dataset prefix")
    return paths[0]


class MockStream(SampleStream):
    """--mock-data: random tokens (no files)."""

    def __init__(self, vocab: int, seq_length: int, seed: int, num_tokens: int = 1 << 16):
        super().__init__(np.random.RandomState(seed).randint(0, vocab, num_tokens).astype(np.int64),
                         seq_length, seed, "mock")


def build_streams(args, log=print):
    """(vocab_size, train, valid) streams for the trainer's flags."""
    if args.mock_data:
        vocab = int(getattr(args, "vocab_size", None) or 256)   # the torch side's mock vocab
        return vocab, MockStream(vocab, args.seq_length, args.seed), MockStream(vocab, args.seq_length, args.seed + 1)
    prefix = dataset_prefix(args, log)
    vocab = vocab_size_of(prefix, args)
    if getattr(args, "is_instruction_dataset", False):
        train, valid = build_splits(prefix, args.split, args.seq_length, args.seed, load_tokenizer(prefix).eod)
        return vocab, train, valid
    ds = IndexedTokens(prefix)
    (t0, t1), (v0, v1), _ = split_bounds(args.split, ds.num_documents)
    train = SampleStream(ds.document_range_tokens(t0, t1), args.seq_length, args.seed, "train")
    valid = None
    if v1 > v0:
        try:
            valid = SampleStream(ds.document_range_tokens(v0, v1), args.seq_length, args.seed + 1, "validation")
        except DataError:
            valid = None
    return vocab, train, valid
