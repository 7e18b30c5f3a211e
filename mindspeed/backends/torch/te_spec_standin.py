"""Megatron-Core's Transformer Engine layer spec, built from Megatron's own local modules, for
Megatron's unit tests on a machine without Transformer Engine.

`get_gpt_layer_with_transformer_engine_spec` asks `TESpecProvider` (bound only when TE imports)
for its modules. The stand-in answers with Megatron's local modules in TE's layout: TE fuses the
norm before the QKV and FC1 projections into the projection (`TELayerNormColumnParallelLinear`,
with parameters `layer_norm_weight` / `layer_norm_bias`), so the stand-in's projection owns its
norm too, and a layer has the parameters, names and checkpoint keys the TE spec gives it. Users'
training refuses `--transformer-impl transformer_engine` without TE instead (megatron_lm.py).
"""
from __future__ import annotations

import importlib
import types

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

GPT_LAYER_SPECS = "megatron.core.models.gpt.gpt_layer_specs"
BERT_LAYER_SPECS = "megatron.core.models.bert.bert_layer_specs"
T5_SPEC = "megatron.core.models.T5.t5_spec"
HETEROGENEOUS_SPECS = "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs"


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """The config's norm (LayerNorm or RMSNorm) on the input, then Megatron's ColumnParallelLinear;
    the norm's parameters carry TE's names, and are replicated across tensor-parallel ranks."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {config.normalization!r}: the stand-in for TE's fused norm "
                             f"has LayerNorm and RMSNorm")
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        device = self.weight.device if self.weight is not None else None
        start = torch.zeros if self.zero_centered_gamma else torch.ones   # the stored gamma
        self.layer_norm_weight = torch.nn.Parameter(start(input_size, dtype=config.params_dtype, device=device))
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(
                torch.zeros(input_size, dtype=config.params_dtype, device=device))
        else:
            self.register_parameter("layer_norm_bias", None)
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            if param is not None:      # replicated across TP: grads all-reduced under sequence parallelism
                param.sequence_parallel = config.sequence_parallel

    def forward(self, input_, *args, **kwargs):
        gamma = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        shape = (self.input_size,)
        if self.normalization == "LayerNorm":
            normed = F.layer_norm(input_, shape, gamma, self.layer_norm_bias, self.eps)
        else:
            normed = F.rms_norm(input_, shape, gamma, self.eps)
        return super().forward(normed, *args, **kwargs)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        # TE's fused projection fills in the data-parallel group a caller's metadata lacks;
        # ColumnParallelLinear reads it from the metadata (KeyError 'dp_cp_group')
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)


class LayerNormColumnParallelLinearGathered(LayerNormColumnParallelLinear):
    """The heterogeneous GPT's linear replacement of a whole attention or MLP (hidden -> hidden, TE's
    fused norm first), its output gathered over tensor-parallel ranks as Megatron's local one does."""

    def __init__(self, config, tp_comm_buffer_name=None, *args, **kwargs):
        super().__init__(config.hidden_size, config.hidden_size, config=config, init_method=config.init_method,
                         gather_output=False, bias=config.add_bias_linear, skip_bias_add=False, is_expert=False)

    def forward(self, x, **kwargs):
        from megatron.core.transformer.heterogeneous import linear_replacements
        out, bias = super().forward(x)
        return linear_replacements._gather_from_tensor_parallel_region(out, self.config), bias


class TelessTESpecProvider(LocalSpecProvider):
    """TESpecProvider's answers from Megatron's local modules: the norm fused into the following
    column-parallel projection, as TE's spec has it; every other module the local spec's."""

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self):
        return LayerNormColumnParallelLinear

    def linear(self):
        # TE's replicated linear (MLA's down projections); the local spec gives ColumnParallelLinear,
        # whose sharded output MLA gathers itself
        return ColumnParallelLinear


def apply_te_spec_standin(patcher) -> bool:
    """Bind the stand-in where Megatron's GPT layer specs look up TESpecProvider, and the block's
    final norm (TENorm, the config's LayerNorm or RMSNorm) as the local spec's norm, when Transformer
    Engine left them unbound; True if they were bound."""
    if hasattr(gpt_layer_specs, "TESpecProvider"):
        return False      # Transformer Engine is installed: its own provider stays
    patcher.define(f"{GPT_LAYER_SPECS}.TESpecProvider", TelessTESpecProvider,
                   reason="Transformer Engine absent: TE's layer spec from Megatron's local modules")
    patcher.define(f"{GPT_LAYER_SPECS}.TENorm", gpt_layer_specs.LNImpl,
                   reason="Transformer Engine absent: the TE decoder block's final norm is the local spec's")
    return True


class TelessDotProductAttention(DotProductAttention):
    """Megatron's local attention in TE's attention's place: BERT tells the two apart by class (the
    local one wants the local attention backend; TE's takes any, with the mask TE's version needs)."""


def _te_spec_from_local_modules(original):
    """BERT's, T5's and the heterogeneous GPT's TE specs name TE's modules in their own module's
    globals (no provider to stand in for) and raise or fail without TE: Megatron's own function runs
    with those names bound to the stand-ins instead (the norm: the module's local-spec norm)."""
    module_globals = original.__globals__
    standins = {"HAVE_TE": True, "TELayerNormColumnParallelLinear": LayerNormColumnParallelLinear,
                "TEDotProductAttention": TelessDotProductAttention, "TERowParallelLinear": RowParallelLinear,
                "TEColumnParallelLinear": ColumnParallelLinear,
                "TELayerNormColumnParallelLinearGathered": LayerNormColumnParallelLinearGathered,
                "TENorm": module_globals.get("LNImpl", gpt_layer_specs.LNImpl)}
    return types.FunctionType(original.__code__, {**module_globals, **standins}, original.__name__,
                              original.__defaults__)


#: Megatron's TE spec functions that read TE's module names from their module's globals (a function
#: runs with the globals its module had when it was bound: the helpers it calls are bound before it)
TE_SPEC_FUNCTIONS = {
    BERT_LAYER_SPECS: ("get_bert_layer_with_transformer_engine_spec",),
    T5_SPEC: ("encoder_model_with_transformer_engine_default_spec", "decoder_model_with_transformer_engine_default_spec"),
    HETEROGENEOUS_SPECS: ("_get_qk_layernorm", "_get_heterogenous_attention_spec", "_get_heterogenous_mlp_spec",
                          "get_gpt_heterogeneous_layer_spec"),
}


def apply_te_spec_function_standins(patcher) -> int:
    """Megatron's BERT, T5 and heterogeneous GPT TE layer specs from the local modules (as the GPT
    one above) when Transformer Engine is absent; their test modules build them at import. The count bound."""
    bound = 0
    for module_name, functions in TE_SPEC_FUNCTIONS.items():
        module = importlib.import_module(module_name)
        if module.HAVE_TE:
            continue
        for name in functions:
            patcher.wrap(f"{module_name}.{name}", _te_spec_from_local_modules,
                         reason="Transformer Engine absent: its TE layer spec from Megatron's local modules")
            bound += 1
    return bound
