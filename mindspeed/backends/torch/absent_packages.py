"""Megatron-Core's version probes for CUDA-only packages, answering "not installed" when the
package is absent instead of raising.

`is_te_min_version` compares `get_te_version()` with a version; without Transformer Engine that
is `None >= Version` (TypeError), and before core 0.13 `get_te_version()` imports Transformer
Engine and raises ModuleNotFoundError; Megatron's own code and tests call the probe at import and
in fixtures. flash-attn's `is_fa_min_version` imports flash-attn (its tests' skipif marks call it).
Installed packages keep Megatron's answer unchanged.

The same for Megatron's fused softmax: `FusedScaleMaskSoftmax.is_kernel_available` answers from the
config and the shapes alone, then the forward imports the CUDA extension (Apex's / Megatron's fused
kernels). Without the extension the kernel is not available, and Megatron's torch softmax runs.
"""
from __future__ import annotations

import importlib
import importlib.util

TE_PROBES = ("is_te_min_version",)
FA_PROBE = "is_fa_min_version"           # flash-attn's, the same pattern (Megatron's skipif marks call it)
SOFTMAX = "megatron.core.fusions.fused_softmax.FusedScaleMaskSoftmax.is_kernel_available"
SOFTMAX_EXTENSION = "scaled_masked_softmax_cuda"    # the one its availability check itself imports


def _wrap_te_probe(original):
    utils = importlib.import_module("megatron.core.utils")

    def probe(*args, **kwargs):
        if _te_version(utils) is None:
            return False        # Transformer Engine absent: no version is at least anything
        return original(*args, **kwargs)
    return probe


def _wrap_fa_probe(original):
    def probe(*args, **kwargs):
        if importlib.util.find_spec("flash_attn") is None:
            return False        # flash-attn absent: get_fa_version imports it
        return original(*args, **kwargs)
    return probe


def _te_version(utils):
    try:
        return utils.get_te_version()
    except ImportError:     # cores before 0.13 import Transformer Engine to read its version
        return None


def _wrap_softmax_probe(original):
    def is_kernel_available(self, *args, **kwargs):
        return importlib.util.find_spec(SOFTMAX_EXTENSION) is not None and original(self, *args, **kwargs)
    return is_kernel_available


def apply_absent_package_probes(patcher) -> None:
    utils = importlib.import_module("megatron.core.utils")
    for name in TE_PROBES:
        if hasattr(utils, name):
            patcher.wrap(f"megatron.core.utils.{name}", _wrap_te_probe,
                         reason="Transformer Engine absent: its version probe answers False", aliases="megatron")
    if hasattr(utils, FA_PROBE):
        patcher.wrap(f"megatron.core.utils.{FA_PROBE}", _wrap_fa_probe,
                     reason="flash-attn absent: its version probe answers False", aliases="megatron")
    if importlib.util.find_spec(SOFTMAX_EXTENSION) is None:
        importlib.import_module("megatron.core.fusions.fused_softmax")
        patcher.wrap(SOFTMAX, _wrap_softmax_probe,
                     reason=f"{SOFTMAX_EXTENSION} absent: Megatron's torch softmax, not the fused kernel")
