"""Datasets and batches for GPT pretraining: Megatron-Core GPTDataset over indexed datasets.

Every rank reads the (deterministic) dataset itself: no broadcast across tensor/pipeline ranks is
needed, and the order of samples is Megatron's pretraining-sampler order, so a run resumed at
iteration N sees exactly the batches the uninterrupted run saw.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import (GPTDataset, GPTDatasetConfig, MockGPTDataset,
                                                _get_ltor_masks_and_position_ids)
from megatron.core.datasets.indexed_dataset import get_bin_path
from megatron.core.datasets.utils import get_blend_from_list

from mindspeed.data.errors import DataError
from mindspeed.data.indexed_reader import check_dataset, split_bounds
from mindspeed.data.shakespeare import ensure_dataset
from mindspeed.data.tokenizer import CharLevelTokenizer, load_tokenizer
from mindspeed.features import documents
from mindspeed.features.memory import shared_mask
from mindspeed.features.memory.shared_mask import SharedMasks
from mindspeed.data import instruction_samples

# segments: --neat-pack's sample numbers when documents.on (get_batch turns them into document ends)
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids", "segments")


def dataset_prefixes(data_path) -> list[str]:
    """'w1 p1 w2 p2' or 'p1 p2' -> [p1, p2]."""
    blend, _weights = get_blend_from_list(data_path)
    return blend


def indexed_prefixes(args, components=instruction_samples.COMPONENTS) -> list[str]:
    """The indexed datasets behind --data-path: its prefixes, or with --is-instruction-dataset
    each prefix's `components` (input_ids and labels)."""
    prefixes = dataset_prefixes(args.data_path)
    if not args.is_instruction_dataset:
        return prefixes
    return [instruction_samples.component_prefix(p, key) for p in prefixes for key in components]


def token_prefixes(args) -> list[str]:
    """The datasets holding input token ids (what the vocabulary bounds)."""
    return indexed_prefixes(args, components=("input_ids",))


def resolve_data(args, log=print):
    """Fill args.data_path (default corpus) and return the tokenizer; check every dataset file."""
    if args.mock_data:
        import string
        return CharLevelTokenizer(string.printable)
    if not args.data_path:
        args.data_path = [ensure_dataset(log=log)]
    for prefix in indexed_prefixes(args):
        check_dataset(prefix)       # missing / truncated / corrupt files first
    tokenizer = load_tokenizer(dataset_prefixes(args.data_path)[0], args.tokenizer_type, args.tokenizer_model)
    for prefix in token_prefixes(args):
        check_dataset(prefix, tokenizer.vocab_size)
    return tokenizer


def unigram_entropy(prefixes: list[str], vocab_size: int) -> float:
    """Loss (nats/token) of the best context-free model: the entropy of token frequencies."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for prefix in prefixes:
        index_dtype = check_dataset(prefix).dtype
        tokens = np.memmap(get_bin_path(prefix), dtype=index_dtype, mode="r")
        counts += np.bincount(tokens, minlength=vocab_size)[:vocab_size]
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _dataset_config(args, tokenizer, packed: bool) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else get_blend_from_list(args.data_path),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=not packed,   # varlen attention reads the EOD positions
        mid_level_dataset_surplus=0.005,
    )


def check_splits_have_documents(args) -> None:
    """Megatron's GPTDataset loops forever building a split with no document (its epoch count
    never reaches the samples asked for), and every split with a weight is built, even one asked for
    no samples (--eval-iters 0). Refuse first."""
    prefixes = dataset_prefixes(args.data_path)
    for prefix in prefixes:
        documents = check_dataset(prefix).num_documents
        for name, (start, end), weight in zip(("train", "valid", "test"), split_bounds(args.split, documents),
                                              (args.split.replace("/", ",").split(",") + ["0", "0"])[:3]):
            # weight 0: never built; any other weight is built, even for 0 samples (its extra token
            # alone is one more than an empty split ever holds)
            wanted = float(weight) > 0
            if wanted and end <= start:
                raise DataError(f"dataset {prefix!r} has {documents} document(s): its {name} split "
                                f"(--split {args.split}) gets none; add documents or change --split")


class InstructionGPTDataset:
    """Instruction samples as GPTDataset items: Megatron's own masks and positions (so --reset-*
    and --eod-mask-loss act as in pretraining), the loss mask also zero on the prompt."""

    def __init__(self, samples: instruction_samples.InstructionSamples, length: int, args, eod: int, packed: bool):
        self.samples, self.length, self.args, self.eod, self.packed = samples, length, args, eod, packed
        self.epoch_samples = samples.num_samples      # one epoch (len() is the whole run's)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        sample = self.samples.example(index)
        tokens = torch.from_numpy(sample["tokens"])
        a = self.args
        attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
            tokens, self.eod, a.reset_position_ids, a.reset_attention_mask, a.eod_mask_loss, not self.packed)
        item = {}
        if "segments" in sample:      # --neat-pack: the stored sample numbers separate, not eod tokens
            segments = torch.from_numpy(sample["segments"])
            position_ids = neat_pack_positions(segments, a.reset_position_ids)
            if self.packed:       # varlen attention: get_batch reads the numbers, no [s, s] mask
                item["segments"] = segments
            else:
                attention_mask = neat_pack_mask(segments)
        item.update({"tokens": tokens, "labels": torch.from_numpy(sample["labels"]),
                     "loss_mask": loss_mask * torch.from_numpy(sample["loss_mask"]), "position_ids": position_ids,
                     "length": sample["length"]})
        if attention_mask is not None:
            item["attention_mask"] = attention_mask
        return item


def neat_pack_mask(segments: torch.Tensor) -> torch.Tensor:
    """Megatron's [1, s, s] attention mask (True = hidden) letting a token see only the earlier tokens
    of its own sample (the path without flash attention or CP)."""
    n = segments.numel()
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    same = segments.view(-1, 1) == segments.view(1, -1)
    return ~(causal & same).unsqueeze(0)


def neat_pack_positions(segments: torch.Tensor, reset_position_ids: bool) -> torch.Tensor:
    """Position ids restarting at 0 in each sample with --reset-position-ids (MindSpeed-LLM's
    neat-pack positions; padding, segment 0, at 0)."""
    n = segments.numel()
    positions = torch.arange(n, dtype=torch.long)
    if reset_position_ids:
        starts = torch.ones(n, dtype=torch.bool)
        starts[1:] = segments[1:] != segments[:-1]
        first = torch.cummax(torch.where(starts, positions, 0), 0).values   # where each token's run began
        positions = torch.where(segments > 0, positions - first, 0)
    return positions


def build_instruction_datasets(args, tokenizer, sizes, packed: bool):
    train, valid = instruction_samples.build_splits(dataset_prefixes(args.data_path)[0], args.split, args.seq_length,
                                                 args.seed, tokenizer.eod, args.neat_pack)
    wrap = lambda samples, size: InstructionGPTDataset(samples, max(size, 1), args, tokenizer.eod, packed)
    return wrap(train, sizes[0]), (wrap(valid, sizes[1]) if valid else None), None


def build_datasets(args, tokenizer, packed: bool = False):
    """(train, valid, test) GPTDatasets sized for the whole run; `packed`: the batches carry packed
    documents (Session.packed_documents), so no dense attention mask is built."""
    gbs = args.global_batch_size
    sizes = [args.train_iters * gbs, args.eval_iters * gbs, args.eval_iters * gbs]
    if args.is_instruction_dataset:
        return build_instruction_datasets(args, tokenizer, sizes, packed)
    if not args.mock_data:
        check_splits_have_documents(args)
    cls = MockGPTDataset if args.mock_data else GPTDataset
    cfg = _dataset_config(args, tokenizer, packed)   # no blend -> Megatron's mock mode
    try:
        train, valid, test = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, cfg).build()
    except (AssertionError, ValueError, IndexError) as err:
        raise DataError(f"cannot build train/valid/test splits {args.split!r} from {args.data_path}: "
                        f"{err}") from err
    if train is None or len(train) == 0:
        raise DataError(f"the training split of {args.data_path} is empty (--split {args.split})")
    return train, valid, test


def microbatches(dataset, consumed_samples: int, args, masks: SharedMasks | None = None) -> Iterator[dict]:
    """Megatron's pretraining-sampler order: each global batch is consecutive samples, and data
    parallel rank r takes micro-batch slice r of it. Plain causal masks are `masks`' one object (the
    reader's: BatchReader.masks; without, this iterator's own)."""
    if dataset is None:
        return
    masks = SharedMasks() if masks is None else masks
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    mbs = args.micro_batch_size
    position = consumed_samples
    shared = shared_mask.plain_causal(args)     # one mask object for every micro-batch, not a stack each
    while True:
        start = position + dp_rank * mbs
        samples = [dataset[(start + i) % len(dataset)] for i in range(mbs)]
        batch = {key: masks.causal_mask(len(samples[0]["tokens"]), "cpu")
                 if shared and key == "attention_mask" else torch.stack([torch.as_tensor(s[key]) for s in samples])
                 for key in samples[0] if key in BATCH_KEYS}
        if args.variable_seq_lengths and "length" in samples[0]:
            batch = cut_to_longest(batch, max(s["length"] for s in samples), args, masks)
        yield batch
        position += mbs * dp_size


def cut_to_longest(batch: dict, longest: int, args, masks: SharedMasks) -> dict:
    """--variable-seq-lengths: the micro-batch as long as its longest sample (rounded up to
    length_multiple, at most --seq-length) instead of --seq-length; the pipeline stages exchange
    each micro-batch's shape. What is cut is padding: no loss, and causal attention never reads it."""
    n = instruction_samples.longest_length([longest], args)
    out = {k: v[:, :n] for k, v in batch.items() if k != "attention_mask"}
    if "attention_mask" in batch:
        mask = batch["attention_mask"]
        out["attention_mask"] = masks.causal_mask(n, mask.device) if shared_mask.is_shared(mask) \
            else mask[..., :n, :n]
    return out


def shard_for_context_parallel(batch: dict, shard: Callable | None = None) -> dict:
    """THE place where a batch is cut for context parallelism (identity when cp size is 1).

    `shard`: the CP feature's sharding (Session.shard_batch); without one, Megatron-Core's own
    load-balanced split (2*cp chunks, rank r keeps r and 2cp-1-r) is used.
    """
    if parallel_state.get_context_parallel_world_size() == 1:
        return batch
    if shard is not None:
        return shard(batch)
    from megatron.core.utils import get_batch_on_this_cp_rank
    return get_batch_on_this_cp_rank(batch)


def get_batch(data_iterator, device: str, eod: int | None = None, shard: Callable | None = None,
              masks: SharedMasks | None = None) -> dict:
    """The next micro-batch on `device`, this CP rank's part of it (cut by `shard`, see
    shard_for_context_parallel). With `eod` (packed documents), the documents' ends are taken from the
    whole sequences first and travel as the batch's attention_mask (features/documents.py), kept on the
    cpu: attention layers read them as lists; --neat-pack's batches bring sample numbers (`segments`)
    instead, which take precedence. A shared causal mask becomes `masks`' one on `device`."""
    batch = dict(next(data_iterator))
    masks = SharedMasks() if masks is None else masks
    segments = batch.pop("segments", None)
    ends = None
    if segments is not None:
        ends = [documents.ends_from_segments(row) for row in segments]
    elif eod is not None:
        ends = [documents.ends_from_eod(row, eod) for row in batch["tokens"]]
    batch = {k: masks.causal_mask(v.shape[-1], device) if shared_mask.is_shared(v)
             else v.to(device, non_blocking=True) for k, v in batch.items()}
    if ends is not None:
        batch["attention_mask"] = documents_mask(ends)
    return shard_for_context_parallel(batch, shard)


@dataclass(frozen=True)
class BatchReader:
    """How the trainer reads its micro-batches: onto `device`, documents' ends from `eod` when batches
    carry packed documents (None: they do not), cut for context parallelism by `shard`; `masks`: the
    run's shared causal masks (its micro-batch iterators make theirs from the same)."""
    device: str
    eod: int | None = None
    shard: Callable | None = None
    masks: SharedMasks = field(default_factory=SharedMasks, compare=False)

    @classmethod
    def for_session(cls, session, args, eod: int | None) -> "BatchReader":
        """The reader a run's applied features call for (mindspeed.session.Session)."""
        return cls(args.device_name, eod if session.packed_documents(args) else None, session.shard_batch)

    @property
    def packed(self) -> bool:
        """The batches carry packed documents: the datasets build no dense attention mask."""
        return self.eod is not None

    def __call__(self, data_iterator) -> dict:
        return get_batch(data_iterator, self.device, self.eod, self.shard, self.masks)


def documents_mask(ends: list[list[int]]) -> torch.Tensor:
    """The attention_mask that carries a micro-batch's documents (features/documents.py)."""
    return torch.tensor(documents.padded_rows(ends), dtype=torch.int32)


def samples_per_epoch_note(dataset, args) -> str:
    if dataset is None:
        return ""
    samples = getattr(dataset, "epoch_samples", len(dataset))
    return f"{samples} samples (~{math.floor(samples / args.global_batch_size)} iterations)"
