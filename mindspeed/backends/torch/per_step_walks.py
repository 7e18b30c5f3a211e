"""Two of Megatron-Core's per-step walks that find nothing to do on a model without DTensors or
MoE router state, cut short (the same results; fewer Python calls on every step).

- The gradient norm and clipping call `to_local_if_dtensor` once per gradient, twice a step, and it
  enters and leaves a `no_grad` context for each, DTensor or not. A plain tensor is returned as it
  is, which is what the call returned.
- `finalize_model_grads` calls `reset_model_temporary_tensors` (core 0.13 on) every step. It walks
  every module of the model looking for MoE router state, which it resets only with
  `--moe-router-enable-expert-bias` or a global aux-loss load balancing; with neither it resets
  nothing, so there is no walk.
"""
from __future__ import annotations

import importlib

import torch

TO_LOCAL_SITE = "megatron.core.optimizer.clip_grads.to_local_if_dtensor"
RESET_MODULE = "megatron.core.distributed.finalize_model_grads"
RESET_SITE = RESET_MODULE + ".reset_model_temporary_tensors"
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _wrap_to_local(original):
    def to_local_if_dtensor(tensor):
        if type(tensor) in PLAIN_TENSORS:
            return tensor
        return original(tensor)
    to_local_if_dtensor.__name__ = original.__name__
    return to_local_if_dtensor


def router_state_to_reset(config) -> bool:
    """Megatron-Core's own conditions inside reset_model_temporary_tensors."""
    balancing = getattr(config, "moe_router_load_balancing_type", "")
    return bool(getattr(config, "moe_router_enable_expert_bias", False)) or (
        balancing == "global_aux_loss" or "global_aux_loss" in balancing)


def _wrap_reset(original):
    def reset_model_temporary_tensors(config, model):
        if router_state_to_reset(config):
            original(config, model)
    reset_model_temporary_tensors.__name__ = original.__name__
    return reset_model_temporary_tensors


def apply_per_step_walks(patcher) -> None:
    import megatron.core.optimizer.clip_grads  # noqa: F401  (the site's module)
    patcher.wrap(TO_LOCAL_SITE, _wrap_to_local, reason="a plain tensor is its own local shard")
    if hasattr(importlib.import_module(RESET_MODULE), "reset_model_temporary_tensors"):    # core >= 0.13
        patcher.wrap(RESET_SITE, _wrap_reset, reason="no MoE router state to reset: no walk over the modules",
                     aliases="megatron")
