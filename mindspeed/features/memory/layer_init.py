"""One wrap of Megatron-Core's TransformerLayer.__init__ shared by the features that adjust a layer
once it is built (--recompute-activation-function / --recompute-norm, --swap-attention): the patcher
allows one patch per target, and these features must combine."""
from __future__ import annotations

import functools
import inspect

TARGET = "megatron.core.transformer.transformer_layer.TransformerLayer.__init__"


def add_hook(patcher, hook, reason: str) -> None:
    """After every TransformerLayer is constructed, hook(layer, arguments): the constructor's
    arguments by name, defaults filled in (e.g. `layer_number`, the index inside the model chunk).
    Hooks run in the order they were added."""
    record = patcher.find(TARGET)
    if record is None:
        hooks: list = []

        def wrap_init(original):
            signature = inspect.signature(original)

            @functools.wraps(original)
            def __init__(self, *a, **kw):
                original(self, *a, **kw)
                bound = signature.bind(self, *a, **kw)
                bound.apply_defaults()
                for run in hooks:
                    run(self, bound.arguments)
            __init__._mindspeed_layer_hooks = hooks
            return __init__
        record = patcher.wrap(TARGET, wrap_init, reason=reason)
    else:
        record.reason = f"{record.reason}; {reason}"
    record.new._mindspeed_layer_hooks.append(hook)


def has_hook(patcher, fn) -> bool:
    """Whether a hook made from `fn` (itself or a functools.partial of it) is installed."""
    record = patcher.find(TARGET)
    hooks = getattr(record.new, "_mindspeed_layer_hooks", []) if record is not None else []
    return any(getattr(h, "func", h) is fn for h in hooks)
