"""TorchInductor's kernel cache, rid of what a killed compile left behind.

TorchInductor keeps every C++ kernel it compiles (Megatron's `jit_fuser` functions, any
torch.compile on a CPU), and the small programs it builds to probe the CPU's vector ISA, as files
in its cache (TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_<user>; precompiled headers
always under the default), and builds one only when the file is missing. The compiler writes that
file in place, so a run killed while it compiles leaves an empty or cut-off file, and from then on
every run that needs it, of any job, fails: "file too short" loading a kernel, or, where the ISA
probe is the broken file, generated code that no longer compiles.

Before anything compiles, `remove_broken_kernels()` deletes each such file: empty, an ELF file cut
off before its section header table (linkers write it last), or one whose build directory torch
never got to remove (`<name>_CxxBuild`, made before the compiler starts and removed after it
succeeds). It takes torch's own lock of that file first and skips a file whose lock is held: a live
compile may still be writing it. Torch then builds the file again.

Why this and not a cache per job: precompiled headers ignore TORCHINDUCTOR_CACHE_DIR, a restart of
the same job (torchrun --max-restarts) would meet its own broken file, and a cache per run
compiles every kernel again at every start. It reads file sizes and 64-byte headers only, in the
few hundred folders a cache holds, and imports nothing of torch (torch._inductor costs seconds).
"""
from __future__ import annotations

import getpass
import os
import re
import shutil
import struct
import tempfile

try:
    import fcntl
except ImportError:              # Windows: no flock; nothing is removed there
    fcntl = None

SUFFIXES = (".so", ".o", ".gch")
BUILD_DIR_SUFFIX = "_CxxBuild"   # torch._inductor.cpp_builder._BUILD_TEMP_DIR
ELF_MAGIC = b"\x7fELF"


def default_cache_dir() -> str:
    """Where torch puts its cache when TORCHINDUCTOR_CACHE_DIR is unset (its own rule)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def cache_dirs() -> list[str]:
    default = default_cache_dir()
    chosen = os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default)
    return [chosen] + ([default] if chosen != default else [])


def is_cut_short(path: str) -> bool:
    """An empty file, or an ELF file whose section header table would end past the file's end.
    A file that is not ELF (a precompiled header) is judged by its size only."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    if size == 0:
        return True
    if head[:4] != ELF_MAGIC:
        return False
    wide, order = head[4:5] == b"\x02", "<" if head[5:6] == b"\x01" else ">"
    if len(head) < (64 if wide else 52):
        return True
    offset, sizes = (0x28, 0x3A) if wide else (0x20, 0x2E)
    (table,) = struct.unpack_from(order + ("Q" if wide else "I"), head, offset)
    entry, count = struct.unpack_from(order + "HH", head, sizes)
    return table + entry * count > size


def _lock_path(path: str) -> str:
    # torch locks a kernel as <key>.lock in a `locks` folder: the cache's, or the headers' own
    folder, name = os.path.split(path)
    root = folder if os.path.basename(folder) == "precompiled_headers" else os.path.dirname(folder)
    return os.path.join(root, "locks", name.split(".", 1)[0] + ".lock")


def _remove_unless_locked(path: str, build_dir: str | None) -> bool:
    lock = _lock_path(path)
    try:
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:                  # a live compile holds it
        os.close(fd)
        return False
    try:
        os.remove(path)
        if build_dir:
            shutil.rmtree(build_dir, ignore_errors=True)
        return True
    except OSError:
        return False
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _candidates(root: str):
    for folder in (os.path.join(root, d) for d in os.listdir(root)):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if name.endswith(SUFFIXES):
                yield os.path.join(folder, name)


def remove_broken_kernels(roots: list[str] | None = None) -> list[str]:
    """Delete the cache's empty, cut-off or half-built files; returns their paths."""
    if fcntl is None:
        return []
    removed = []
    for root in roots if roots is not None else cache_dirs():
        try:
            paths = list(_candidates(root))
        except OSError:              # no cache yet, or not ours to read
            continue
        for path in paths:
            build_dir = os.path.splitext(path)[0] + BUILD_DIR_SUFFIX
            if not os.path.isdir(build_dir):
                build_dir = None
            if (build_dir or is_cut_short(path)) and _remove_unless_locked(path, build_dir):
                removed.append(path)
    return removed
