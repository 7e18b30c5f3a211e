"""The Megatron-Core hook of --moe-tp-extend-ep: experts are split over the TP x EP ranks instead
of each expert's weights being split over TP.

Megatron-Core builds the expert grid separately from the attention grid (expert tensor
parallelism, "parallel folding"), so the extended layout is that grid with expert TP 1 and expert
parallelism TP*EP: the expert-parallel group is then the TP x EP block of ranks (TP fastest, so
extended rank = ep_rank * TP + tp_rank, the order MindSpeed upstream uses), every rank holds
num_experts / (TP*EP) whole experts, and the token dispatcher routes over that group. Two patches
make it so: the process groups (initialize_model_parallel) and the config the MoE layer reads.
"""
from __future__ import annotations

import inspect

from mindspeed.features.fused import config_fields

PS = "megatron.core.parallel_state.initialize_model_parallel"
WHY = "--moe-tp-extend-ep: experts sharded over TP x EP (expert TP 1, expert parallelism TP*EP)"


def _wrap_initialize(original):
    signature = inspect.signature(original)

    def initialize_model_parallel(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        a["expert_model_parallel_size"] = a["expert_model_parallel_size"] * a["tensor_model_parallel_size"]
        a["expert_tensor_parallel_size"] = 1
        return original(*bound.args, **bound.kwargs)
    return initialize_model_parallel


def install(patcher, backend) -> None:
    """The groups and the config (`backend` unused: the layout is Megatron's, no collective of its own)."""
    patcher.wrap(PS, _wrap_initialize, reason=WHY)
    # the config's own values must agree with the groups (Megatron's MoE code reads both); applied
    # in this order, and skipped for a config that already has expert TP 1 (a copy of an extended one)
    config_fields.override(patcher, "expert_model_parallel_size",
                           lambda c: (c.expert_model_parallel_size * c.tensor_model_parallel_size
                                      if c.num_moe_experts and c.expert_tensor_parallel_size != 1 else None), WHY)
    config_fields.override(patcher, "expert_tensor_parallel_size",
                           lambda c: 1 if c.num_moe_experts else None, WHY)
