"""Set TransformerConfig fields that switch Megatron-Core onto a fused code path.

Megatron builds its config from the host's own arguments (mindspeed.training sets e.g.
bias_activation_fusion=False because its CUDA kernels are absent); a MindSpeed fused feature
that supplies the kernel turns the field back on here, after Megatron's own __post_init__ checks.
One patch serves every feature: each adds its fields to the shared override table.
"""
from __future__ import annotations

from typing import Any, Callable

TARGET = "megatron.core.transformer.transformer_config.TransformerConfig.__post_init__"


def override(patcher, field: str, value_for: Callable[[Any], Any], reason: str) -> None:
    """After every TransformerConfig.__post_init__, set `field` to value_for(config) unless None. The
    table of fields lives on the one patch (undone with it), shared by the features that add to it."""
    applied = patcher.find(TARGET)
    if applied is None:
        applied = patcher.wrap(TARGET, _wrap_post_init, reason="MindSpeed fused features set config fields: " + reason)
    applied.new.overrides[field] = value_for


def _wrap_post_init(original):
    def __post_init__(self):
        original(self)
        for field, value_for in __post_init__.overrides.items():
            value = value_for(self)
            if value is not None:
                object.__setattr__(self, field, value)
    __post_init__.overrides = {}      # field -> fn(config) -> value (None: leave as is)
    return __post_init__
