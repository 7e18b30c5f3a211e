"""Megatron flag defaults that several layers compare against (the trainers' parser, the flag
checks, the support matrix's rows, the MindSpore trainer): one value, framework-free."""

DISTRIBUTED_TIMEOUT_MINUTES = 10      # --distributed-timeout-minutes

# Megatron ("host") flags MindSpeed's features read that no feature declares as a host flag (one
# that does keeps the default in its Flag): the value a namespace without the flag stands for.
# The plan's namespace is filled with them (flags/mindspeed_flags.fill_host_defaults), so a
# programmatic user's Namespace or a partial command line reads as the host's defaults. Model
# sizes stay unknown (None): a user's own model is not the built-in trainers' default one.
HOST_FLAG_DEFAULTS = {
    "num_layers": None,
    "seq_length": None,
    "num_attention_heads": None,
    "num_query_groups": None,
    "group_query_attention": None,        # not said: a --num-query-groups given counts
    "world_size": None,                   # derived by the host (WORLD_SIZE)
    "data_parallel_size": None,           # derived by the host
    "micro_batch_size": None,
    "global_batch_size": None,
    "num_layers_per_virtual_pipeline_stage": None,
    "add_bias_linear": False,
    "defer_embedding_wgrad_compute": False,
    "overlap_param_gather_with_optimizer_step": False,
    "recompute_modules": None,
    "moe_token_dispatcher_type": "alltoall",
    "moe_expert_capacity_factor": None,
    "is_instruction_dataset": False,
    "neat_pack": False,
    "ckpt_format": "torch_dist",          # the built-in trainers' default (Megatron-LM's is torch_dist too)
}


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocab so each TP shard of the embedding has the same size."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple
