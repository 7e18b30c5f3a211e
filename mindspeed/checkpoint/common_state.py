"""A torch_dist checkpoint's common.pt (the state every rank shares: iteration, samples consumed,
scheduler, and in Megatron-LM's checkpoints its `args`) read with torch's weights-only unpickler.

Besides tensors and plain containers, Megatron-LM stores its argparse Namespace in common.pt, and
in it a few enums and a signal. Those types, and no others, are allowed here; a file naming any
other global is refused in one phrase, without running it. (Importing megatron.core also
registers Megatron's own list of safe types with torch, process-wide; that list holds data
types only.)
"""
from __future__ import annotations

import argparse
import re
import signal

import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.enums import AttnBackend

# what Megatron-LM's common.pt holds beyond tensors (core_v0.12 and core_v0.16 `args`)
COMMON_GLOBALS = [argparse.Namespace, signal.Signals, ModelType, AttnBackend]
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


class UnsafeCommonState(ValueError):
    """common.pt names a global outside COMMON_GLOBALS; the message is one phrase."""


def load_common(path: str, extra_globals: tuple = (), mmap: bool = False) -> dict:
    """The common state in `path`. UnsafeCommonState when it names a type that is not allowed
    (COMMON_GLOBALS and `extra_globals`); other damage raises what torch.load raises. mmap: the
    tensors stay in the file until read (a legacy checkpoint's whole model)."""
    try:
        with torch.serialization.safe_globals([*COMMON_GLOBALS, *extra_globals]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:
        # torch's text runs to paragraphs and suggests turning the weights-only load off: only the global is kept
        found = _GLOBAL.search(str(err)) if "GLOBAL" in str(err) else None
        if found is None:
            raise
        raise UnsafeCommonState(f"{path} names {found.group(1)}, which a checkpoint's common state never "
                                "holds (not loaded: it could run code)") from None
