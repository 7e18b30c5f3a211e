"""`--cache-dir`: processed datasets kept under a key of everything that decides their content
(input files' paths, sizes and modification times; the tokenizer files' bytes; the settings), so
running the same preprocessing again copies the result instead of tokenizing again.
`--overwrite-cache` tokenizes anyway and replaces the cached copy."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

from mindspeed.files import atomic_write


def cache_key(files: list[str], tokenizer_dir: str, settings: dict) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for path in files:
        st = os.stat(path)
        h.update(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for name in sorted(os.listdir(tokenizer_dir)):
        path = os.path.join(tokenizer_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:24]


def entry_dir(cache_dir: str, key: str) -> str:
    return os.path.join(os.path.expanduser(cache_dir), "preprocessed", key)


def restore(entry: str, output_prefix: str, suffixes: list[str]) -> bool:
    """Copy a complete cache entry to output_prefix + suffix for every suffix; False when absent."""
    if not all(os.path.isfile(os.path.join(entry, "out" + s)) for s in suffixes):
        return False
    for suffix in suffixes:
        source = os.path.join(entry, "out" + suffix)
        atomic_write(output_prefix + suffix, lambda temp, source=source: shutil.copyfile(source, temp))
    return True


def store(entry: str, output_prefix: str, suffixes: list[str]) -> None:
    """Copy the outputs into the entry (a new folder renamed into place: never half an entry)."""
    temp = f"{entry}.tmp{os.getpid()}"
    os.makedirs(temp, mode=0o750, exist_ok=True)
    for suffix in suffixes:
        shutil.copyfile(output_prefix + suffix, os.path.join(temp, "out" + suffix))
    if os.path.isdir(entry):
        shutil.rmtree(entry)
    os.replace(temp, entry)
