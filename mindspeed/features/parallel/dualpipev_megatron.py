"""DualPipeV's Megatron-Core hook: the layer numbers of the V's second chunk.

Megatron numbers virtual stage v of pipeline rank r as stage v x PP + r; the V's chunk 1 on rank r is
stage 2PP-1-r, which is Megatron's numbering of rank PP-1-r's virtual stage 1. Wrapping
get_transformer_layer_offset so gives the chunk its global layer numbers: the layers it builds,
and the keys of its checkpoint shards, which therefore load into any other pipeline layout.

Megatron-Core's combined forward-backward step (--moe-fb-overlap) asks parallel_state whether a
chunk computes the loss (the last pipeline rank's last virtual stage); on the V it is the chunk
that holds the output layer, rank 0's chunk 1.
"""
from __future__ import annotations

OFFSET = "megatron.core.transformer.transformer_layer.get_transformer_layer_offset"
CALC_LOSS = "megatron.core.pipeline_parallel.schedules.forward_step_calc_loss"


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
    patcher.wrap(CALC_LOSS, _loss_on_the_output_chunk, reason="DualPipeV: the loss is on rank 0's chunk 1")


def _loss_on_the_output_chunk(original):
    def forward_step_calc_loss(model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data,
                               num_microbatches, forward_data_store, cp_group_size=None, is_last_stage=None):
        if is_last_stage is None:
            from megatron.core import parallel_state
            from megatron.core.utils import get_attr_wrapped_model
            is_last_stage = bool(get_attr_wrapped_model(model, "post_process"))
            cp_group_size = parallel_state.get_context_parallel_world_size()
        return original(model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data, num_microbatches,
                        forward_data_store, cp_group_size, is_last_stage)
    return forward_step_calc_loss
