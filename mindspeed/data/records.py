"""Input files -> records (dicts): JSON arrays, JSON lines, parquet tables, Arrow files (as Hugging
Face `datasets` caches them), CSV rows (a header line names the fields), text lines.

`--input` takes files, directories (every supported file below them) and globs. Each record keeps
its origin (`file:line` or `file:row`) so a refusal can say where the bad record is.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Sequence

from mindspeed.data.errors import DataError

TEXT_SUFFIXES = (".txt", ".json", ".jsonl")
RECORD_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow", ".csv", ".txt")


def expand_inputs(inputs: Sequence[str], suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[str]:
    """Files named by `inputs` (files, directories searched recursively, globs), in a stable order."""
    suffixes = tuple(suffixes)
    files: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(p for p in glob.glob(os.path.join(item, "**", "*"), recursive=True)
                           if os.path.isfile(p) and p.endswith(suffixes))
            if not found:
                raise DataError(f"input directory {item!r} holds no {'/'.join(suffixes)} files")
            files += found
        elif any(ch in item for ch in "*?["):
            found = sorted(p for p in glob.glob(item) if os.path.isfile(p))
            if not found:
                raise DataError(f"input pattern {item!r} matches no files")
            files += found
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise DataError(f"input {item!r} does not exist")
    bad = [f for f in files if not f.endswith(suffixes)]
    if bad:
        raise DataError(f"input {bad[0]!r} is not a {'/'.join(suffixes)} file")
    return files


def _json_lines(path: str) -> Iterator[tuple[str, object]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err


def _json_file(path: str) -> Iterator[tuple[str, object]]:
    """A .json file is one JSON array of records, or JSON lines (as Hugging Face `datasets` reads it)."""
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if not head.startswith("["):
        yield from _json_lines(path)
        return
    try:
        with open(path, encoding="utf-8") as f:
            items = json.load(f)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from err
    for i, item in enumerate(items):
        yield f"{path}[{i}]", item


def _parquet_rows(path: str) -> Iterator[tuple[str, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install -e \".[data]\")") from err
    try:
        table = pq.ParquetFile(path)
    except Exception as err:   # pyarrow raises ArrowInvalid / OSError variants for damaged files
        raise DataError(f"{path}: not a readable parquet file ({err})") from err
    yield from _batched_rows(path, table.iter_batches(batch_size=1024))


def _batched_rows(path: str, batches) -> Iterator[tuple[str, object]]:
    """Rows of pyarrow record batches as records, numbered across the batches."""
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            yield f"{path}:row {row}", record
            row += 1


def _arrow_rows(path: str) -> Iterator[tuple[str, object]]:
    """An Arrow IPC stream (what `datasets` writes to its cache) or an Arrow IPC file."""
    try:
        import pyarrow as pa
    except ImportError as err:
        raise DataError(f"{path}: reading Arrow files needs pyarrow (pip install -e \".[data]\")") from err
    try:
        with pa.memory_map(path) as source:
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                table = pa.ipc.open_file(source).read_all()
    except Exception as err:   # ArrowInvalid / OSError for damaged files
        raise DataError(f"{path}: not a readable Arrow file ({err})") from err
    yield from _batched_rows(path, table.to_batches(max_chunksize=1024))


def _csv_rows(path: str) -> Iterator[tuple[str, object]]:
    """One record per row, keyed by the header line's names (values are strings)."""
    import csv
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames:
            raise DataError(f"{path}: a CSV input needs a header line naming its fields")
        try:
            for record in reader:
                if None in record:     # more values than the header names
                    raise DataError(f"{path}:{reader.line_num}: {len(record[None])} more values than the "
                                    f"header's {len(reader.fieldnames)} fields")
                yield f"{path}:{reader.line_num}", record
        except csv.Error as err:
            raise DataError(f"{path}:{reader.line_num}: not valid CSV ({err})") from err


def _text_lines(path: str, key: str) -> Iterator[tuple[str, object]]:
    """One record per non-empty line, under `key` (Hugging Face `datasets`' text loader)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if line.strip():
                yield f"{path}:{lineno}", {key: line}


def read_records(path: str, text_key: str = "text") -> Iterator[tuple[str, dict]]:
    """(origin, record) pairs of one file; anything that is not a JSON object is refused."""
    if path.endswith(".parquet"):
        rows = _parquet_rows(path)
    elif path.endswith(".arrow"):
        rows = _arrow_rows(path)
    elif path.endswith(".csv"):
        rows = _csv_rows(path)
    elif path.endswith(".jsonl"):
        rows = _json_lines(path)
    elif path.endswith(".json"):
        rows = _json_file(path)
    else:
        rows = _text_lines(path, text_key)
    for origin, record in rows:
        if not isinstance(record, dict):
            raise DataError(f"{origin}: a record must be a JSON object, got {type(record).__name__}")
        yield origin, record


def all_records(files: Sequence[str], text_key: str = "text") -> Iterator[tuple[str, dict]]:
    for path in files:
        yield from read_records(path, text_key)
