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
from mindspeed.data.instruction_samples import build_splits, longest_length
from mindspeed.data.shakespeare import ensure_dataset
from mindspeed.data.tokenizer import CharLevelTokenizer, load_tokenizer, tokenizer_path
from mindspeed.training.mindspore.order_cache import OrderCache, order_cache


def vocab_size_of(prefix: str, args) -> int:
    """Vocabulary size from the tokenizer file beside the dataset (or --vocab-size)."""
    if args.vocab_size:
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
    """Samples of seq_length+1 tokens from one split, in a seeded order, endlessly; `cache`
    (order_cache.OrderCache, --data-cache-path): where each epoch's order is kept between runs."""

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int, name: str, cache: OrderCache | None = None):
        self.tokens, self.seq_length, self.seed, self.cache = tokens, seq_length, seed, cache
        self.num_samples = (len(tokens) - 1) // seq_length if len(tokens) > 1 else 0
        if self.num_samples == 0:
            raise DataError(f"the {name} split has {len(tokens)} tokens, fewer than one sample of "
                            f"{seq_length + 1}; use more data, a shorter --seq-length or another --split")
        self._orders = {}
        if cache is not None:
            self._order(0)          # a bad cache file stops the run before any work

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            build = lambda: np.random.RandomState(self.seed + epoch).permutation(self.num_samples)
            self._orders = {epoch: build() if self.cache is None else self.cache.order(epoch, self.num_samples, build)}
        return self._orders[epoch]

    def sample(self, index: int) -> np.ndarray:
        epoch, pos = divmod(index, self.num_samples)
        start = int(self._order(epoch)[pos]) * self.seq_length
        return self.tokens[start:start + self.seq_length + 1]

    def example(self, index: int) -> dict:
        row = self.sample(index)
        return {"tokens": row[:-1], "labels": row[1:], "loss_mask": np.ones(self.seq_length, np.float32)}


def micro_batch(stream, first_sample: int, mbs: int, eod_rules=None, cut_args=None) -> dict:
    """`mbs` consecutive examples of a stream (SampleStream, or instruction_samples.InstructionSamples);
    eod_rules (eod.EodRules): the loss mask, positions and attention mask of packed documents;
    cut_args (the flags, with --variable-seq-lengths): instruction examples cut to their longest."""
    examples = [stream.example(first_sample + i) for i in range(mbs)]
    tokens, labels, loss_mask = (np.stack([e[k] for e in examples]) for k in ("tokens", "labels", "loss_mask"))
    batch = {"tokens": tokens.astype(np.int32), "labels": labels.astype(np.int32),
             "loss_mask": loss_mask.astype(np.float32)}
    if cut_args is not None and "length" in examples[0]:
        n = longest_length([e["length"] for e in examples], cut_args)
        batch = {key: value[:, :n] for key, value in batch.items()}
    return batch if eod_rules is None else eod_rules.apply(batch)


def micro_batches_for_step(stream, consumed: int, args, dp_rank: int, dp_size: int, eod_rules=None,
                           batch_size: int | None = None) -> list:
    """This rank's micro-batches of the global batch (batch_size, else --global-batch-size samples)
    starting at sample `consumed`."""
    mbs, per_step = args.micro_batch_size, args.micro_batch_size * dp_size
    n_micro = (batch_size or args.global_batch_size) // per_step
    cut = args if args.variable_seq_lengths else None
    return [micro_batch(stream, consumed + m * per_step + dp_rank * mbs, mbs, eod_rules, cut) for m in range(n_micro)]


def eod_id(args, flag_tokenizer=None) -> int:
    """The end-of-document token id, where the torch trainer takes it: the tokenizer the flags
    name, mock data's character tokenizer, else the one saved beside the dataset."""
    if flag_tokenizer is not None:
        return int(flag_tokenizer.eod)
    if args.mock_data:
        import string
        return CharLevelTokenizer(string.printable).eod     # the torch trainer's mock tokenizer
    return int(load_tokenizer(dataset_prefix(args)).eod)


def blend_of(data_path: list) -> tuple[list[str], list[float] | None]:
    """--data-path as Megatron reads it: 'w1 p1 w2 p2' (weights and prefixes) or 'p1 p2 ...'
    (prefixes; weights None)."""
    items = list(data_path)
    if len(items) > 1 and len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            return [p.strip() for p in items[1::2]], weights
    return [p.strip() for p in items], None


def dataset_prefixes(args, log=print) -> tuple[list[str], list[float] | None]:
    """The dataset prefixes and weights --data-path names (the bundled Shakespeare dataset without one)."""
    if not args.data_path:
        return [ensure_dataset(log=log)], None
    return blend_of(args.data_path)


def dataset_prefix(args, log=print) -> str:
    """The first dataset prefix --data-path names: a blend's datasets share its tokenizer."""
    return dataset_prefixes(args, log)[0][0]


class BlendedStream:
    """Several streams' samples in the order of Megatron's BlendedDataset: sample i comes from the
    dataset furthest below its share of the first i samples (weight x i minus the samples it gave;
    ties to the first), and is that dataset's next sample."""

    def __init__(self, streams: list, weights: list):
        total = float(sum(weights))
        if total <= 0 or min(weights) < 0:
            raise DataError(f"--data-path weights {weights}: need non-negative weights with a positive sum")
        self.streams, self.weights = streams, np.asarray(weights, np.float64) / total
        self.num_samples = sum(s.num_samples for s in streams)
        self.dataset_index = np.zeros(0, np.int64)       # which stream gives sample i
        self.sample_index = np.zeros(0, np.int64)        # and which of its samples
        self._given = np.zeros(len(streams), np.int64)

    def _extend(self, upto: int) -> None:
        n = len(self.dataset_index)
        if upto < n:
            return
        size = max(upto + 1, 2 * n, 1024)
        datasets, samples = np.zeros(size - n, np.int64), np.zeros(size - n, np.int64)
        for k, i in enumerate(range(n, size)):
            d = int(np.argmax(self.weights * max(float(i), 1.0) - self._given))
            datasets[k], samples[k] = d, self._given[d]
            self._given[d] += 1
        self.dataset_index = np.concatenate([self.dataset_index, datasets])
        self.sample_index = np.concatenate([self.sample_index, samples])

    def example(self, index: int) -> dict:
        self._extend(index)
        return self.streams[int(self.dataset_index[index])].example(int(self.sample_index[index]))


class MockStream(SampleStream):
    """--mock-data: random tokens (no files)."""

    def __init__(self, vocab: int, seq_length: int, seed: int, num_tokens: int = 1 << 16, cache_args=None):
        cache = order_cache(cache_args, dict(dataset="mock", vocab=vocab, tokens=num_tokens, seq_length=seq_length,
                                             seed=seed, split="mock"))
        super().__init__(np.random.RandomState(seed).randint(0, vocab, num_tokens).astype(np.int64),
                         seq_length, seed, "mock", cache)


def build_streams(args, log=print):
    """(vocab_size, train, valid) streams for the trainer's flags."""
    if args.mock_data:
        vocab = int(args.vocab_size or 256)   # the torch side's mock vocab
        return vocab, MockStream(vocab, args.seq_length, args.seed, cache_args=args), \
            MockStream(vocab, args.seq_length, args.seed + 1, cache_args=args)
    prefixes, weights = dataset_prefixes(args, log)
    _check_one_tokenizer(prefixes)
    vocab = vocab_size_of(prefixes[0], args)
    if args.is_instruction_dataset:
        if len(prefixes) > 1:
            raise DataError("--is-instruction-dataset reads one --data-path prefix on the mindspore trainer")
        train, valid = build_splits(prefixes[0], args.split, args.seq_length, args.seed,
                                    load_tokenizer(prefixes[0]).eod)
        return vocab, train, valid
    splits = [_split_streams(prefix, args) for prefix in prefixes]
    if len(splits) == 1:
        return (vocab,) + splits[0]
    trains, valids = [t for t, _ in splits], [v for _, v in splits]
    # without weights Megatron blends by the datasets' sizes
    train = BlendedStream(trains, weights or [t.num_samples for t in trains])
    valid = None
    if all(v is not None for v in valids):
        valid = BlendedStream(valids, weights or [v.num_samples for v in valids])
    return vocab, train, valid


def cache_note(args, streams) -> str | None:
    """What --data-cache-path did for these streams (a log line), or None without the flag."""
    if not args.data_cache_path:
        return None
    caches = [c for s in streams for c in ([s.cache] if hasattr(s, "cache") else
                                           [t.cache for t in getattr(s, "streams", ())]) if c is not None]
    return (f"> data cache {os.path.abspath(args.data_cache_path)}: read {sum(c.read for c in caches)}, wrote "
            f"{sum(c.written for c in caches)} sample-order files")


def _check_one_tokenizer(prefixes: list) -> None:
    """A blend's token ids mean the same in every dataset: their saved tokenizers are one."""
    saved = {}
    for prefix in prefixes:
        path = tokenizer_path(prefix)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                saved[prefix] = json.load(f)
    if any(desc != next(iter(saved.values())) for desc in saved.values()):
        raise DataError(f"--data-path blends {', '.join(saved)}, preprocessed with different tokenizers (their "
                        ".tokenizer.json files differ): preprocess them with one tokenizer")


def _split_streams(prefix: str, args) -> tuple:
    """(train, validation or None) streams of one dataset, split by --split."""
    ds = IndexedTokens(prefix)
    (t0, t1), (v0, v1), _ = split_bounds(args.split, ds.num_documents)
    train = _stream(ds, prefix, (t0, t1), args, args.seed, "train")
    valid = None
    if v1 > v0:
        try:
            valid = _stream(ds, prefix, (v0, v1), args, args.seed + 1, "validation")
        except DataError:
            valid = None
    return train, valid


def _stream(ds: IndexedTokens, prefix: str, documents: tuple, args, seed: int, name: str) -> SampleStream:
    tokens = ds.document_range_tokens(*documents)
    cache = order_cache(args, dict(dataset=os.path.abspath(prefix), documents=list(documents), tokens=len(tokens),
                                   seq_length=args.seq_length, seed=seed, split=name))
    return SampleStream(tokens, args.seq_length, seed, name, cache)
