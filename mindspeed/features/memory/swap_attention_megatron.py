"""--swap-attention on Megatron-Core: each TransformerLayer's modules named by --swap-modules run
their forward inside the activation swapper's scope (activation_swap.py)."""
from __future__ import annotations

import functools

from mindspeed.features.memory import layer_init, parameter_identity
from mindspeed.features.memory.activation_swap import ActivationSwapper

def _swapped_forward(forward, layer: int, swapper: ActivationSwapper):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with swapper.scope(layer):
            return forward(*args, **kwargs)
    return run


def install(patcher, names: list[str], memory) -> ActivationSwapper:
    """names: the TransformerLayer modules to swap (swap_features.swap_module_names). Returns the
    swapper (on the live backend's memory) the layers built from now on run their modules in."""
    swapper = ActivationSwapper(memory)

    def swap_modules(layer, _arguments):
        for name in names:
            module = getattr(layer, name, None)
            if module is not None and any(True for _ in module.parameters()):   # not an IdentityOp
                module.forward = _swapped_forward(module.forward, layer.layer_number, swapper)

    parameter_identity.install(patcher, memory)
    layer_init.add_hook(patcher, swap_modules, "--swap-attention: swapped modules save their activations on the host")
    return swapper
