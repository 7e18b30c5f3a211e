"""DualPipeV's Megatron-Core hook: the layer numbers of the V's second chunk.

Megatron numbers virtual stage v of pipeline rank r as stage v x PP + r; the V's chunk 1 on rank r is
stage 2PP-1-r, which is Megatron's numbering of rank PP-1-r's virtual stage 1. Wrapping
get_transformer_layer_offset so gives the chunk its global layer numbers: the layers it builds,
and the keys of its checkpoint shards, which therefore load into any other pipeline layout.

Megatron-Core's combined forward-backward step (--moe-fb-overlap) asks parallel_state whether a
chunk computes the loss (the last pipeline rank's last virtual stage); on the V it is the chunk
that holds the output layer, rank 0's chunk 1.

--mtp-num-layers: the MTP block goes where upstream puts it, on the V's last stage (rank 0's chunk 1),
beside the output layer. Megatron gives an MTP stage its own copy of the word embeddings and keeps it
equal to the first stage's by an all-reduce over the embedding group; on the V both copies are on
rank 0 (the trainer makes the group that one rank, training/pretrain.py), so the copy starts as chunk
0's (training/model.py) and the hook sums the two copies' gradients where Megatron would all-reduce.
"""
from __future__ import annotations

OFFSET = "megatron.core.transformer.transformer_layer.get_transformer_layer_offset"
CALC_LOSS = "megatron.core.pipeline_parallel.schedules.forward_step_calc_loss"
MTP_LAYERS = "megatron.core.transformer.multi_token_prediction.get_mtp_num_layers_to_build"
EMBEDDING_GRADS = "megatron.core.distributed.finalize_model_grads._allreduce_word_embedding_grads"


def install(patcher, pp: int, mtp: bool = False) -> None:
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
    if mtp:
        patcher.wrap(MTP_LAYERS, _mtp_on_the_output_chunk, aliases="megatron",
                     reason="DualPipeV: the MTP block is on rank 0's chunk 1")
        patcher.wrap(EMBEDDING_GRADS, _sum_the_embedding_copies,
                     reason="DualPipeV: the MTP block's word embeddings are a copy of chunk 0's on the same rank")


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



def _mtp_on_the_output_chunk(original):
    def get_mtp_num_layers_to_build(config, vp_stage=None, pp_rank=None):
        from megatron.core import parallel_state
        rank = parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
        return (config.mtp_num_layers or 0) if (rank, vp_stage) == (0, 1) else 0
    return get_mtp_num_layers_to_build


def _sum_the_embedding_copies(original):
    def allreduce_word_embedding_grads(model, config, embd_group=None, pp_group=None):
        original(model, config, embd_group, pp_group)       # a group of one rank on the V: nothing to reduce
        from megatron.core.utils import get_attr_wrapped_model
        chunks = [get_attr_wrapped_model(m, "pre_process", return_model_obj=True) for m in model]
        if len(chunks) == 2 and chunks[0].pre_process and chunks[1].mtp_process:
            weights = [c.embedding.word_embeddings.weight for c in chunks]
            grads = [w.main_grad if hasattr(w, "main_grad") else w.grad for w in weights]
            if grads[0] is not None and grads[1] is not None:
                grads[0].add_(grads[1])
                grads[1].copy_(grads[0])
    return allreduce_word_embedding_grads
