"""Megatron-Core's local layer spec with the modules the run's features provide, put in by the built-in
trainer itself (ModuleSpec, as Megatron-Core intends), not by patching Megatron's spec providers.

The fused features provide their modules as session parts (features/fused/megatron_specs.py); this
module builds Megatron-Core's own local spec, then puts them in its slots: every norm of a layer (and of
an MTP layer, and the block's final norm) becomes the fused norm, every DotProductAttention the flash
attention, every MoE layer's experts the grouped GEMM's. The same modules Megatron-LM's scripts get from
the process-wide patches of the same features.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from mindspeed.features.fused.megatron_specs import SPEC_CORE_ATTENTION, SPEC_GROUPED_EXPERTS, SPEC_NORM

# the norm classes Megatron-Core's local spec puts in a norm slot (Apex's where installed)
LOCAL_NORMS = (WrappedTorchNorm, FusedLayerNorm)


@dataclass(frozen=True)
class SpecModules:
    """The modules the applied features put into the local spec (None: Megatron-Core's own)."""
    norm: type | None = None                 # every norm slot (rms_norm's FusedNorm)
    core_attention: ModuleSpec | None = None  # every DotProductAttention slot (flash attention)
    grouped_experts: bool = False             # MoE experts as one grouped GEMM (GroupedMLP)

    @classmethod
    def of(cls, session) -> "SpecModules":
        """What `session`'s applied features provide (mindspeed.session.Session.part)."""
        return cls(session.part(SPEC_NORM), session.part(SPEC_CORE_ATTENTION),
                   bool(session.part(SPEC_GROUPED_EXPERTS)))

    @property
    def any(self) -> bool:
        return bool(self.norm or self.core_attention or self.grouped_experts)


def with_modules(spec, modules: SpecModules, num_experts: int | None = None):
    """`spec` (a ModuleSpec, TransformerBlockSubmodules or MTP block submodules) with `modules` in its
    slots; the spec itself is left as it was."""
    experts = _grouped_experts(num_experts) if modules.grouped_experts and num_experts else None
    return _substitute(spec, modules, experts)


def block_with_final_norm(layer: ModuleSpec, config, vp_stage: int | None, norm: type) -> TransformerBlockSubmodules:
    """The block of this stage's layers built from one layer spec, its final norm `norm` (what
    TransformerBlock builds from a layer spec, with Megatron's own norm, otherwise)."""
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=norm)


def _grouped_experts(num_experts: int):
    """The experts' spec Megatron-Core's local spec gives for the grouped GEMM (its GroupedMLP)."""
    grouped = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=True,
                                       moe_use_legacy_grouped_gemm=True)
    return grouped.submodules.mlp.submodules.experts


def _substitute(node, modules: SpecModules, experts):
    if isinstance(node, list):
        new = [_substitute(n, modules, experts) for n in node]
        return new if any(a is not b for a, b in zip(new, node)) else node
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return node
    changes = {}
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        new = _slot(node, f.name, value, modules, experts)
        if new is value:
            new = _substitute(value, modules, experts)
        if new is not value:
            changes[f.name] = new
    return dataclasses.replace(node, **changes) if changes else node


def _slot(owner, name: str, value, modules: SpecModules, experts):
    """What goes into slot `name` of `owner` (value itself: unchanged)."""
    if modules.norm is not None and isinstance(value, type) and issubclass(value, LOCAL_NORMS):
        return modules.norm
    if modules.core_attention is not None and name == "core_attention" and value is DotProductAttention:
        return modules.core_attention
    if experts is not None and name == "experts" and isinstance(owner, MoESubmodules):
        return experts
    return value
