"""DualPipeV's Megatron-Core hook: the layer numbers of the V's second chunk.

Megatron numbers virtual stage v of pipeline rank r as stage v x PP + r; the V's chunk 1 on rank r is
stage 2PP-1-r, which is Megatron's numbering of rank PP-1-r's virtual stage 1. Wrapping
get_transformer_layer_offset so gives the chunk its global layer numbers: the layers it builds,
and the keys of its checkpoint shards, which therefore load into any other pipeline layout.
"""
from __future__ import annotations

OFFSET = "megatron.core.transformer.transformer_layer.get_transformer_layer_offset"


def install(patcher, pp: int) -> None:
    from megatron.core import parallel_state

    def wrap(original):
        def v_layer_offset(config, vp_stage=None, pp_rank=None):
            if vp_stage != 1:
                return original(config, vp_stage, pp_rank)
            rank = parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
            return original(config, 1, pp - 1 - rank)
        return v_layer_offset

    patcher.wrap(OFFSET, wrap, aliases="megatron", reason="DualPipeV: chunk 1 of rank r is stage 2PP-1-r")
