"""glibc's heap keeps the memory a cpu training step frees, for the next step.

torch's cpu allocator takes every tensor from malloc and gives it back when the tensor dies. With
glibc's defaults, a step's activations are mmapped afresh or, once its dynamic threshold has risen,
carved from a heap whose top is handed back to the kernel whenever more than twice that threshold
is free: each step then touches new pages, one page fault per 4 KiB. Fixing the two thresholds
(allocations up to MMAP_THRESHOLD come from the heap; up to TRIM_THRESHOLD of free heap top is
kept) leaves the process at the resident size of its largest step, which it reaches anyway.

Left alone when the user tuned malloc (MALLOC_*_ variables or glibc.malloc tunables) and where
the C library has no mallopt (not glibc).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # glibc's <malloc.h>
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 1 << 30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def user_tuned_malloc(environ=os.environ) -> bool:
    return any(name in environ for name in USER_SETTINGS) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory(environ=os.environ) -> bool:
    """Set the two thresholds in this process; True when set."""
    if user_tuned_malloc(environ):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
