"""Megatron-Core's tensor-parallel region functions are identities over a group of one process.

`copy_to`, `reduce_from`, `scatter_to` and `gather_from_tensor_model_parallel_region` wrap Python
autograd Functions whose forward and backward are each a copy, an all-reduce, a split or a gather
over the tensor-parallel group: over one rank all four return their input. At TP=1 every linear
layer still calls one of them (about 36 Function calls a step in the default example's GPT,
forward and backward); here they return the input itself, which is what the Functions computed.
"""
from __future__ import annotations

from megatron.core import parallel_state

SITE = "megatron.core.tensor_parallel.mappings."
REGIONS = ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
           "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region")


def _wrap_region(original):
    # (input_, group=None) from core 0.13 on, (input_) before: the group is the TP group unless given
    def region(input_, *args, **kwargs):
        group = args[0] if args else kwargs.get("group")
        size = parallel_state.get_tensor_model_parallel_world_size() if group is None else group.size()
        if size == 1:
            return input_
        return original(input_, *args, **kwargs)
    region.__name__ = original.__name__
    return region


def apply_one_rank_regions(patcher) -> None:
    import megatron.core.tensor_parallel.mappings  # noqa: F401  (the sites' module)
    for name in REGIONS:
        patcher.wrap(SITE + name, _wrap_region, reason="a tensor-parallel region over one rank is its input",
                     aliases="megatron")
