"""Megatron-Core's version probes for CUDA-only packages, answering "not installed" when the
package is absent instead of raising.

`is_te_min_version` compares `get_te_version()` with a version; without Transformer Engine that
is `None >= Version` (TypeError), which Megatron's own code and tests call at import and in
fixtures. Installed packages keep Megatron's answer unchanged.
"""
from __future__ import annotations

import importlib

TE_PROBES = ("is_te_min_version",)


def _wrap_te_probe(original):
    utils = importlib.import_module("megatron.core.utils")

    def probe(*args, **kwargs):
        if utils.get_te_version() is None:
            return False        # Transformer Engine absent: no version is at least anything
        return original(*args, **kwargs)
    return probe


def apply_absent_package_probes(patcher) -> None:
    utils = importlib.import_module("megatron.core.utils")
    for name in TE_PROBES:
        if hasattr(utils, name):
            patcher.wrap(f"megatron.core.utils.{name}", _wrap_te_probe,
                         reason="Transformer Engine absent: its version probe answers False", aliases="megatron")
