"""--is-instruction-dataset: fine-tuning samples with the prompt masked from the loss (both trainers).

`--data-path PREFIX` names what an instruction handler of `python -m mindspeed.data` wrote:
PREFIX_packed_input_ids_document and PREFIX_packed_labels_document (labels -100 where the loss
must not look). One document is one sample: cut or padded to seq_length + 1 tokens, then shifted
as in pretraining (tokens = ids[:-1], labels = ids[1:]); the loss mask is 1 exactly where the
stored label of the predicted token is not -100, so prompts, system text and padding carry no loss.
Documents are split into train/valid/test by --split and visited in a seeded order per epoch.
--neat-pack: PREFIX_packed_attention_mask_document numbers the samples of each packed document
(`python -m mindspeed.data --pack --neat-pack`); each example then carries `segments` and no token
predicts across a sample boundary (the trainer keeps attention inside each segment).
Framework-free: the MindSpore trainer uses it as it is, the torch trainer through data.py.
"""
from __future__ import annotations

import math

import numpy as np

from mindspeed.data.handlers import IGNORE_INDEX
from mindspeed.data.errors import DataError
from mindspeed.data.indexed_reader import IndexedTokens, split_bounds

COMPONENTS = ("input_ids", "labels")
SEGMENTS = "attention_mask"         # what --neat-pack reads: sample numbers, 0 on padding


def component_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_packed_{key}_document"


class InstructionDocuments:
    """Document i of the input_ids and labels datasets, checked to belong together."""

    def __init__(self, prefix: str, neat_pack: bool = False):
        try:
            self.ids, self.labels = (IndexedTokens(component_prefix(prefix, k)) for k in COMPONENTS)
            marks = IndexedTokens(component_prefix(prefix, SEGMENTS))
        except DataError as err:
            raise DataError(f"--is-instruction-dataset --data-path {prefix}: {err} (make it with "
                            "`python -m mindspeed.data --handler-name AlpacaStyleInstructionHandler ...`)") from err
        for other in (self.labels, marks):
            if not np.array_equal(self.ids.seq_lengths, other.seq_lengths):
                raise DataError(f"the datasets of {prefix!r} have other lengths than "
                                f"{component_prefix(prefix, 'input_ids')}: rebuild them together")
        if self.ids.num_documents == 0:
            raise DataError(f"instruction dataset {prefix!r} holds no samples")
        # all ones: not neat-packed; a sample number > 1 or a 0 (padding): neat-packed
        neat_data = bool(len(marks.tokens)) and (int(marks.tokens.max()) > 1 or int(marks.tokens.min()) == 0)
        if neat_pack != neat_data:
            fix = ("train with --neat-pack --reset-attention-mask (torch backend; for the MindSpore trainer "
                   "preprocess without --neat-pack)") if neat_data else \
                "drop --neat-pack (or preprocess with --pack --neat-pack)"
            raise DataError(f"--data-path {prefix}: the dataset was {'' if neat_data else 'not '}written with "
                            f"--neat-pack; {fix}")
        self.segments = marks if neat_pack else None
        self.prefix = prefix

    @property
    def num_documents(self) -> int:
        return self.ids.num_documents

    def document(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        segments = None if self.segments is None else self.segments.document_range_tokens(i, i + 1)
        return self.ids.document_range_tokens(i, i + 1), self.labels.document_range_tokens(i, i + 1), segments


class InstructionSamples:
    """The samples of documents [first, end): `example(k)` for any k >= 0 (epochs reshuffle)."""

    def __init__(self, docs: InstructionDocuments, first: int, end: int, seq_length: int, seed: int,
                 pad_id: int, name: str):
        if end <= first:
            raise DataError(f"the {name} split of {docs.prefix!r} has no samples ({docs.num_documents} in all); "
                            "add samples or change --split")
        self.docs, self.first, self.seq_length, self.seed, self.pad_id = docs, first, seq_length, seed, pad_id
        self.num_samples = end - first
        self._orders: dict = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.RandomState(self.seed + epoch).permutation(self.num_samples)}
        return self._orders[epoch]

    def example(self, index: int) -> dict:
        epoch, pos = divmod(index, self.num_samples)
        ids, labels, segments = self.docs.document(self.first + int(self._order(epoch)[pos]))
        n, ids_in = self.seq_length + 1, ids
        fit = lambda a, fill: np.concatenate([a[:n], np.full(max(0, n - len(a)), fill, np.int64)])
        ids, labels = fit(ids, self.pad_id), fit(labels, IGNORE_INDEX)
        keep = labels[1:] != IGNORE_INDEX
        example = {"tokens": ids[:-1], "labels": np.where(keep, labels[1:], ids[1:])}
        if segments is not None:
            segments = fit(segments, 0)
            keep &= segments[1:] == segments[:-1]      # the last token of a sample predicts nothing
            example["segments"] = segments[:-1]
        # tokens taken from the document (the rest is padding): --variable-seq-lengths cuts batches there
        return {**example, "loss_mask": keep.astype(np.float32), "length": min(len(ids_in), n) - 1}


def build_splits(prefix: str, split: str, seq_length: int, seed: int, pad_id: int, neat_pack: bool = False):
    """(train, valid or None) samples of PREFIX; a validation split without documents is None."""
    docs = InstructionDocuments(prefix, neat_pack)
    try:
        (t0, t1), (v0, v1), _ = split_bounds(split, docs.num_documents)
    except DataError as err:
        raise DataError(str(err)) from err
    train = InstructionSamples(docs, t0, t1, seq_length, seed, pad_id, "train")
    valid = InstructionSamples(docs, v0, v1, seq_length, seed + 1, pad_id, "validation") if v1 > v0 else None
    return train, valid


def length_multiple(args) -> int:
    """What a micro-batch's length must divide by: TP with sequence parallelism, 2 x CP (the
    load-balanced chunks)."""
    m = args.tensor_model_parallel_size if args.sequence_parallel else 1
    cp = args.context_parallel_size or 1
    return math.lcm(m, 2 * cp) if cp > 1 else m


def longest_length(lengths, args) -> int:
    """--variable-seq-lengths: a micro-batch's length, that of its longest sample rounded up to
    length_multiple, at most --seq-length. What is cut beyond it is padding: no loss, and causal
    attention never reads it."""
    m = length_multiple(args)
    return min(-(-max(max(lengths), 1) // m) * m, args.seq_length)
