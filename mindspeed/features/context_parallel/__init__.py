"""Context parallelism written once against the backend interface: Ulysses (all_to_all around the
attention kernel), ring attention (K/V rotated with send/recv, merged with ring_attention_update)
and their hybrid. feature.py registers the flags; megatron_hook.py routes Megatron-Core to it."""
from mindspeed.features.context_parallel.attention import context_parallel_attention
from mindspeed.features.context_parallel.groups import CPGroups, build_cp_groups
from mindspeed.features.context_parallel.sharding import BatchSharding, local_positions, shard_batch

__all__ = ["context_parallel_attention", "CPGroups", "build_cp_groups", "BatchSharding",
           "local_positions", "shard_batch"]
