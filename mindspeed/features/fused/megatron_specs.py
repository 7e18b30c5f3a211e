"""Where Megatron-Core's local (non-TE) layer spec takes its modules, per Megatron version.

core >= 0.13: a LocalSpecProvider class whose methods (layer_norm, core_attention, ...) the spec
builders call. core 0.12: `get_gpt_layer_local_spec` reads module globals of gpt_layer_specs at
call time (LNImpl / WrappedTorchNorm, DotProductAttention). Features patch whichever exists.
"""
from __future__ import annotations

import importlib

LOCAL_SPEC_PROVIDER = "megatron.core.models.backends.LocalSpecProvider"
GPT_LAYER_SPECS = "megatron.core.models.gpt.gpt_layer_specs"

# The session parts the fused features provide for a host that builds its spec itself
# (ApplyContext.specs_from_session: the built-in trainers, training/layer_spec.py); other hosts
# (Megatron-LM's scripts, a user's own spec) get the same modules by the patches of this module's targets.
SPEC_NORM = "spec.norm"                      # the norm class for every norm slot
SPEC_CORE_ATTENTION = "spec.core_attention"  # the ModuleSpec for every DotProductAttention slot
SPEC_GROUPED_EXPERTS = "spec.grouped_experts"  # True: MoE experts as one grouped GEMM


def has_local_spec_provider() -> bool:
    try:
        return hasattr(importlib.import_module("megatron.core.models.backends"), "LocalSpecProvider")
    except ImportError:
        return False
