"""--noop-layers on Megatron-Core: the named layers are built as NoopTransformerLayer (no parameters,
output = input) instead of TransformerLayer. Imported only when the feature is applied on torch.

Megatron-Core's combined forward-backward step (--moe-fb-overlap) splits each layer into nodes built
by fine_grained_callables.build_layer_callables, which knows TransformerLayer and the MTP layer only:
a noop layer gets pass-through nodes there, its last node applying the decoder's final norm where it
is the chunk's last layer (as a MoE layer's combine node does)."""
from __future__ import annotations

import importlib.util
import inspect
import sys

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

BLOCK = "megatron.core.transformer.transformer_block.TransformerBlock"
LAYER_CALLABLES = "megatron.core.models.gpt.fine_grained_callables.build_layer_callables"    # Megatron-Core >= 0.14
MEGATRON_LM_FLOPS = "megatron.training.training.num_floating_point_operations"


class NoopTransformerLayer(MegatronModule):
    """A transformer layer that returns its input. layer_number is global and 1-based, as a
    TransformerLayer's is (the block's checkpoint keys and recompute read it)."""

    def __init__(self, config, layer_number: int = 1, global_layer_number: int = 1, **_):
        super().__init__(config)
        self.layer_number = global_layer_number

    mlp = None          # a dense layer to Megatron's combined-step plan (which reads layer.mlp)

    def forward(self, hidden_states, attention_mask=None, context=None, *args, **kwargs):
        # a copy, not the same tensor: the pipeline schedule frees a stage's output tensor after
        # sending it, which must not free the input that backward still reads
        return hidden_states.clone(), context


def _wrap_build_layers(noop: frozenset):
    def wrap(original):
        def _build_layers(self):
            offset = _layer_offset(self)
            specs = self.submodules.layer_specs
            self.submodules.layer_specs = [
                ModuleSpec(module=NoopTransformerLayer, params={"global_layer_number": offset + i + 1})
                if offset + i in noop else spec for i, spec in enumerate(specs)]
            try:
                original(self)
            finally:                    # the spec object may be shared by other blocks
                self.submodules.layer_specs = specs
        return _build_layers
    return wrap


def _layer_offset(block) -> int:
    """Global index of the block's first layer (Megatron-Core 0.12 takes the config alone)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    if "vp_stage" not in inspect.signature(get_transformer_layer_offset).parameters:
        return get_transformer_layer_offset(block.config)
    from megatron.core.utils import get_pg_rank
    return get_transformer_layer_offset(block.config, block.vp_stage, get_pg_rank(block.pg_collection.pp))


def _per_layer_keys(original):
    """Checkpoint keys per layer (decoder.layers.N.*), not one tensor stacked over the layers: a
    stack with the noop layers' rows missing is not a whole tensor."""
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return original(self, prefix, sharded_offsets, dict(metadata or {}, non_homogeneous_layers=True))
    return sharded_state_dict


def _wrap_megatron_lm_flops(noop: frozenset):
    """Megatron-LM's --log-throughput counts args.num_layers layers: count the real ones (and, for a
    dense/MoE mix, the real layers' entries of --moe-layer-freq's list, whose length it checks)."""
    def wrap(original):
        def num_floating_point_operations(args, batch_size):
            layers, pattern = args.num_layers, args.moe_layer_freq
            args.num_layers -= len(noop)
            if isinstance(pattern, list):
                args.moe_layer_freq = [moe for i, moe in enumerate(pattern) if i not in noop]
            try:
                return original(args, batch_size)
            finally:
                args.num_layers, args.moe_layer_freq = layers, pattern
        return num_floating_point_operations
    return wrap


def _noop_nodes(original):
    def build_layer_callables(layer):
        if not isinstance(layer, NoopTransformerLayer):
            return original(layer)

        def passed(node, hidden_states):
            return hidden_states.clone()

        def passed_to_the_norm(node, hidden_states):
            norm = node.chunk_state.model.decoder.final_layernorm
            return norm(hidden_states) if node.is_last_layer and norm is not None else hidden_states.clone()
        return [passed, None, passed_to_the_norm, None, None], {}
    return build_layer_callables


def install(patcher, noop: frozenset) -> None:
    patcher.wrap(BLOCK + "._build_layers", _wrap_build_layers(noop), reason="--noop-layers: pass-through layers")
    if importlib.util.find_spec(LAYER_CALLABLES.rsplit(".", 1)[0]) is not None:
        patcher.wrap(LAYER_CALLABLES, _noop_nodes, reason="--noop-layers: pass-through nodes in the combined step")
    patcher.wrap(BLOCK + ".sharded_state_dict", _per_layer_keys, reason="--noop-layers: per-layer checkpoint keys")
    if "megatron.training.training" in sys.modules:     # under Megatron-LM's pretrain_gpt.py
        patcher.wrap(MEGATRON_LM_FLOPS, _wrap_megatron_lm_flops(noop),
                     reason="--noop-layers: Megatron-LM's FLOP count leaves out noop layers", aliases="megatron")
