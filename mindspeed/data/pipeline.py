"""MindSpeed-LLM-style preprocessing: records -> handler -> (pack / pad) -> indexed datasets.

`run(HandlerConfig)` reads every record of the inputs, encodes them with the handler in `workers`
processes (order kept: the output does not depend on the number of workers), shapes instruction
samples (packing.py) and writes all output datasets at once (indexed.DatasetGroup: temporary
names, renamed together at the end). `n_subs` > 1 cuts the records into that many contiguous
parts, each written by one worker and then concatenated in order (MindSpeed-LLM's --n-subs).
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Iterable

import numpy as np

from mindspeed.data import cache, packing
from mindspeed.data.handlers import build_handler, parse_map_keys
from mindspeed.data.errors import DataError
from mindspeed.data.indexed import DatasetGroup, remove_dataset, token_dtype
from mindspeed.data.records import RECORD_SUFFIXES, all_records, expand_inputs
from mindspeed.data.tokenizer import HuggingFaceTokenizer, save_tokenizer, tokenizer_path
from mindspeed.data.workers import ordered_map


@dataclass
class HandlerConfig:
    inputs: list
    output_prefix: str
    tokenizer_path: str
    handler_name: str = "GeneralPretrainHandler"
    json_keys: list | None = None          # GeneralPretrainHandler only; default ["text"]
    prompt_type: str | None = None
    map_keys: str | None = None            # JSON text, as on the command line
    dataset_additional_keys: list | None = None   # R1AlpacaStyleInstructionHandler: one more dataset each
    append_eod: bool = False
    seq_length: int | None = None
    pack: bool = False
    neat_pack: bool = False                # with pack: attention_mask numbers the samples of a bin
    pad_to_multiple_of: int = 1
    workers: int = 1
    n_subs: int = 1
    log_interval: int = 100
    cache_dir: str | None = None
    overwrite_cache: bool = False


def _check_numbers(cfg: HandlerConfig) -> None:
    for name in ("workers", "n_subs", "log_interval", "pad_to_multiple_of"):
        if getattr(cfg, name) < 1:
            raise DataError(f"--{name.replace('_', '-')} must be a positive integer (got {getattr(cfg, name)})")
    if cfg.seq_length is not None and cfg.seq_length < 2:
        raise DataError(f"--seq-length must be at least 2 (got {cfg.seq_length})")


def _check_shaping(cfg: HandlerConfig, handler) -> None:
    """Flags that shape instruction samples mean nothing for pretraining documents or RL prompts:
    refuse them."""
    if not handler.instruction:
        given = [flag for flag, on in (("--pack", cfg.pack), ("--neat-pack", cfg.neat_pack),
                                       ("--seq-length", cfg.seq_length is not None),
                                       ("--pad-to-multiple-of", cfg.pad_to_multiple_of > 1)) if on]
        if given:
            raise DataError(f"{', '.join(given)} shape instruction samples; GeneralPretrainHandler documents "
                            "are cut into samples by the trainer: drop them")
        return
    if cfg.json_keys is not None:
        raise DataError(f"--json-keys applies to GeneralPretrainHandler; {cfg.handler_name} reads the "
                        "columns --map-keys names")
    if not handler.packable:
        given = [flag for flag, on in (("--pack", cfg.pack), ("--neat-pack", cfg.neat_pack),
                                       ("--pad-to-multiple-of", cfg.pad_to_multiple_of > 1)) if on]
        if given:
            raise DataError(f"{', '.join(given)}: {cfg.handler_name} writes one prompt per record for the RL "
                            "trainer, which neither packs nor pads them: drop them")
    if cfg.neat_pack and not cfg.pack:
        raise DataError("--neat-pack needs --pack (it marks the samples inside packed bins)")
    if cfg.pack and cfg.seq_length is None:
        raise DataError("--pack needs --seq-length (the length of a packed sample)")
    if cfg.pack and cfg.pad_to_multiple_of > 1:
        raise DataError("--pad-to-multiple-of with --pack: packed samples are padded to --seq-length already")


def open_tokenizer(path: str | None) -> HuggingFaceTokenizer:
    if not path:
        raise DataError("handlers need a Hugging Face tokenizer: --tokenizer-type PretrainedFromHF "
                        "--tokenizer-name-or-path DIR")
    if not os.path.isdir(path):
        raise DataError(f"--tokenizer-name-or-path {path!r} is not a directory (a local Hugging Face "
                        "tokenizer folder: tokenizer.json / tokenizer_config.json)")
    return HuggingFaceTokenizer(os.path.abspath(path))


class Progress:
    """The --log-interval line: records so far (of the total when known), rate, tokens."""

    def __init__(self, log, interval: int, label: str = "", total: int | None = None):
        self.log, self.interval, self.label, self.total = log, interval, label, total
        self.count = self.tokens = 0
        self.start = time.perf_counter()

    def tick(self, samples: Iterable[dict | None]) -> Iterable[dict | None]:
        for sample in samples:
            self.count += 1
            self.tokens += len(next(iter(sample.values()))) if sample is not None else 0
            if self.count % self.interval == 0:
                rate = self.count / max(time.perf_counter() - self.start, 1e-9)
                of = f"/{self.total}" if self.total else ""
                self.log(f"> {self.label}processed {self.count}{of} records ({rate:.0f} records/s, "
                         f"{self.tokens} tokens)")
            yield sample


def _dtypes(handler, tokenizer) -> dict:
    # instruction labels hold -100: int32 for the three (MindSpeed-LLM's layout)
    return {k: np.int32 if handler.instruction else token_dtype(tokenizer.vocab_size) for k in handler.keys}


def _write(cfg, handler, tokenizer, items, prefixes: dict, workers: int, progress: Progress,
           part: bool = False) -> dict:
    """Encode `items` ((origin, record) pairs) and write the datasets at `prefixes` (`part`: one of
    --n-subs, which may end up empty)."""
    group = DatasetGroup(prefixes, _dtypes(handler, tokenizer), tokenizer.vocab_size, checked=handler.token_keys)
    dropped = skipped = 0
    try:
        samples = progress.tick(ordered_map(lambda item: handler.encode(*item), items, workers))
        if handler.instruction and cfg.pack:
            kept, dropped = packing.fits(list(samples), cfg.seq_length)
            samples = packing.pack(kept, cfg.seq_length, tokenizer.pad_id, neat=cfg.neat_pack)
        for sample in samples:
            if sample is None:           # a record the handler leaves out (R1: a null answer)
                skipped += 1
                continue
            if handler.instruction:
                if not cfg.pack:
                    if cfg.seq_length is not None and handler.too_long(sample, cfg.seq_length):
                        dropped += 1
                        continue
                    if handler.packable:
                        sample = packing.pad_to_multiple(sample, cfg.pad_to_multiple_of, tokenizer.pad_id)
            else:
                sample = {k: v for k, v in sample.items() if len(v)}   # empty texts are not documents
                if not sample:
                    continue
            group.add(sample)
        group.commit(allow_empty=part)
    except BaseException:
        group.abort()
        raise
    return {"documents": group.documents, "tokens": group.tokens, "dropped": dropped, "skipped": skipped}


def _write_subsets(cfg, handler, tokenizer, files, prefixes: dict, log) -> dict:
    records = list(all_records(files))
    n = min(cfg.n_subs, max(len(records), 1))
    bounds = np.linspace(0, len(records), n + 1).astype(int)
    parts = [{k: f"{p}.sub{i:03d}.tmp{os.getpid()}" for k, p in prefixes.items()} for i in range(n)]

    def job(i):
        progress = Progress(log, cfg.log_interval, f"[part {i + 1}/{n}] ", int(bounds[i + 1] - bounds[i]))
        return _write(cfg, handler, tokenizer, records[bounds[i]:bounds[i + 1]], parts[i], 1, progress, part=True)

    try:
        results = list(ordered_map(job, range(n), min(cfg.workers, n), chunksize=1))
        group = DatasetGroup(prefixes, _dtypes(handler, tokenizer))
        try:
            for part, result in zip(parts, results):
                if result["documents"]:          # Megatron's reader cannot map an empty part
                    group.append(part)
            group.commit()
        except BaseException:
            group.abort()
            raise
    finally:
        for part in parts:
            remove_dataset(*part.values())
    return {"documents": group.documents, "tokens": group.tokens, "dropped": sum(r["dropped"] for r in results),
            "skipped": sum(r["skipped"] for r in results)}


def _output_suffixes(cfg, handler, prefixes: dict) -> list[str]:
    """Every file written, as suffixes of --output-prefix (what the cache stores)."""
    suffixes = [p[len(cfg.output_prefix):] + ext for p in prefixes.values() for ext in (".bin", ".idx")]
    owners = [cfg.output_prefix] if handler.instruction else list(prefixes.values())
    return suffixes + [tokenizer_path(p)[len(cfg.output_prefix):] for p in owners]


def run(cfg: HandlerConfig, log=print) -> dict:
    _check_numbers(cfg)
    files = expand_inputs(cfg.inputs, RECORD_SUFFIXES)
    tokenizer = open_tokenizer(cfg.tokenizer_path)
    handler = build_handler(cfg.handler_name, tokenizer, json_keys=cfg.json_keys or ["text"],
                            prompt_type=cfg.prompt_type, map_keys=parse_map_keys(cfg.map_keys),
                            append_eod=cfg.append_eod, additional_keys=cfg.dataset_additional_keys)
    _check_shaping(cfg, handler)
    prefixes = handler.output_prefixes(cfg.output_prefix)
    suffixes = _output_suffixes(cfg, handler, prefixes)
    entry = None
    if cfg.cache_dir:
        settings = {k: v for k, v in asdict(cfg).items() if k not in ("inputs", "output_prefix", "workers",
                                                                      "log_interval", "cache_dir",
                                                                      "overwrite_cache")}
        entry = cache.entry_dir(cfg.cache_dir, cache.cache_key(files, cfg.tokenizer_path, settings))
        if not cfg.overwrite_cache and cache.restore(entry, cfg.output_prefix, suffixes):
            log(f"> reused the cached result {entry} (--overwrite-cache to process again)")
            return {"cached": True, "prefixes": prefixes}

    log(f"> {cfg.handler_name}: {len(files)} input file(s), tokenizer {tokenizer.name} "
        f"(vocab {tokenizer.vocab_size}), {cfg.workers} worker(s)")
    if cfg.n_subs > 1:
        stats = _write_subsets(cfg, handler, tokenizer, files, prefixes, log)
    else:
        stats = _write(cfg, handler, tokenizer, all_records(files), prefixes, cfg.workers,
                       Progress(log, cfg.log_interval))
    for owner in ([cfg.output_prefix] if handler.instruction else prefixes.values()):
        save_tokenizer(tokenizer, owner)
    if entry is not None:
        cache.store(entry, cfg.output_prefix, suffixes)
    dropped = f", dropped {stats['dropped']} longer than --seq-length {cfg.seq_length}" if stats["dropped"] else ""
    dropped += f", left out {stats['skipped']} records with a null answer" if stats["skipped"] else ""
    log(f"> wrote {', '.join(p + '.bin/.idx' for p in prefixes.values())}: {stats['documents']} "
        f"{'packed samples' if cfg.pack else 'documents'}, {stats['tokens']} tokens{dropped}")
    return {**stats, "cached": False, "prefixes": prefixes}
