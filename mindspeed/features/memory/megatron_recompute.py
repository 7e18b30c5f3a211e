"""Megatron-Core hook of --recompute-activation-function / --recompute-norm (torch backend).

A TransformerLayer construction hook (layer_init.py) marks the layers chosen by --...-num-layers (the
constructor's `layer_number` is the index inside the model chunk, 1-based) and, for the norm
feature, reroutes each chosen layer's input/pre-MLP norm; one wrap of MLP.forward recomputes the
activation of the MLPs (dense, MoE experts, shared experts) inside marked layers. Everything goes
through recompute_output of the run's backend.memory, handed to the hooks at install.
"""
from __future__ import annotations

import functools

from mindspeed.features.memory import layer_init

MLP_FORWARD = "megatron.core.transformer.mlp.MLP.forward"
ACT_MARK = "_mindspeed_recompute_activation"
# (norm, the submodule that reads the norm's output and saves it for backward)
NORM_CONSUMERS = (("input_layernorm", "self_attention"), ("pre_mlp_layernorm", "mlp"))


def _chosen(on: bool, limit, local_number: int) -> bool:
    return on and (limit is None or local_number <= limit)


def _choose_layers(memory, act, norm, layer, arguments) -> None:
    local = arguments["layer_number"]
    if _chosen(*act, local):
        from megatron.core.transformer.mlp import MLP
        for module in layer.mlp.modules():
            if isinstance(module, MLP):
                setattr(module, ACT_MARK, True)
    if _chosen(*norm, local):
        _recompute_norms(layer, memory)


def install(patcher, args, memory) -> None:
    """The layers' hooks, recomputing through `memory` (the run's backend.memory)."""
    if layer_init.has_hook(patcher, _choose_layers):     # both recompute features share the hook
        return
    act = (bool(args.recompute_activation_function), args.recompute_activation_function_num_layers)
    norm = (bool(args.recompute_norm), args.recompute_norm_num_layers)
    layer_init.add_hook(patcher, functools.partial(_choose_layers, memory, act, norm),
                        "--recompute-activation-function / --recompute-norm: choose the layers")
    if act[0]:
        patcher.wrap(MLP_FORWARD, functools.partial(_wrap_mlp_forward, memory=memory),
                     reason="--recompute-activation-function")


# activation -------------------------------------------------------------------------------------
def _activation(mlp, original_forward, x, bias, scale):
    """Exactly Megatron's activation code, whatever the config (fused bias-SwiGLU/GeLU, GLU, clamp):
    the original MLP.forward runs with fc1 handing back (x, bias) and fc2 capturing its input."""
    captured = []
    stand_ins = {"linear_fc1": lambda _h: (x, bias), "linear_fc2": lambda a: (captured.append(a) or a, None)}
    mlp.__dict__.update(stand_ins)      # instance attributes shadow the registered submodules
    try:
        original_forward(mlp, None, per_token_scale=scale)
    finally:
        for name in stand_ins:
            del mlp.__dict__[name]
    return captured[0]


def _wrap_mlp_forward(original, memory):
    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not getattr(self, ACT_MARK, False) or per_token_scale is not None:
            # per_token_scale: no caller in core 0.16.1 passes it; its bias tail is left to Megatron
            return original(self, hidden_states, per_token_scale, **kwargs)
        x, bias = self.linear_fc1(hidden_states)
        act = memory.recompute_output(
            lambda x, bias: _activation(self, original, x, bias, None), x, bias)
        output, output_bias = self.linear_fc2(act.output)
        act.discard(output)                 # fc2 saved the activation: free it until backward
        return output, output_bias
    return forward


# norms ------------------------------------------------------------------------------------------
def _recompute_norms(layer, memory) -> None:
    from megatron.core.transformer.identity_op import IdentityOp
    for norm_name, consumer_name in NORM_CONSUMERS:
        norm, consumer = getattr(layer, norm_name), getattr(layer, consumer_name)
        if isinstance(norm, IdentityOp):
            continue
        pending = []
        norm_forward = norm.forward

        def forward(x, *a, _norm_forward=norm_forward, _pending=pending, **kw):
            handle = memory.recompute_output(lambda t: _norm_forward(t, *a, **kw), x)
            _pending.append(handle)
            return handle.output

        def discard(_module, _inputs, output, _pending=pending):
            first = output[0] if isinstance(output, (tuple, list)) else output
            while _pending:
                _pending.pop().discard(first)

        norm.forward = forward              # per instance: state-dict names and the class stay as they are
        consumer.register_forward_hook(discard)
