"""`--workers N`: an order-preserving map over worker processes, so the output is the same
whatever N is. Workers are forked: they inherit the function and its tokenizer instead of
unpickling them (a Hugging Face tokenizer is costly to pickle and to load again)."""
from __future__ import annotations

import multiprocessing
import os
from typing import Callable, Iterable, Iterator

_FUNCTION: Callable | None = None


def _call(item):
    return _FUNCTION(item)


def _quiet_worker() -> None:
    # the tokenizers library's own thread pool is not fork-safe; one worker, one thread
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def ordered_map(function: Callable, items: Iterable, workers: int, chunksize: int = 32) -> Iterator:
    """function(item) for each item, in order; in `workers` forked processes when workers > 1."""
    global _FUNCTION
    if workers <= 1:
        yield from map(function, items)
        return
    _FUNCTION = function
    context = multiprocessing.get_context("fork")
    with context.Pool(workers, initializer=_quiet_worker) as pool:
        try:
            yield from pool.imap(_call, items, chunksize=chunksize)
        finally:
            _FUNCTION = None
