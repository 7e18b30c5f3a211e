"""Megatron-FSDP on a CPU, gloo standing in for NCCL.

- With `gradient_reduce_div_fusion` (its default) Megatron-FSDP reduces gradients with NCCL's
  PREMUL_SUM (each rank's gradient times the scaling factor, then the sum), which gloo refuses
  ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). Megatron's own other branch scales the gradient in
  place, then sums: the same products and the same sum, so that branch is taken.
- `fully_shard_model(device_mesh=None)` builds its default mesh for "cuda"; DTensor then moves each
  gradient shard to "cuda" in the post-backward hook (outside the shim's cuda -> cpu mode). The
  default mesh is built on the cpu.
"""
from __future__ import annotations

import copy
import importlib.util

PACKAGE = "megatron.core.distributed.fsdp.src.megatron_fsdp"
SITE = f"{PACKAGE}.param_and_grad_buffer.gradient_reduce_preprocessing"
MESH_SITE = f"{PACKAGE}.fully_shard.init_device_mesh"


def _wrap_preprocessing(original):
    def gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config):
        if scaling_factor is not None and getattr(ddp_config, "gradient_reduce_div_fusion", False):
            ddp_config = copy.copy(ddp_config)
            ddp_config.gradient_reduce_div_fusion = False   # scale in place, then ReduceOp.SUM
        return original(grad_data, scaling_factor, ddp_config)
    return gradient_reduce_preprocessing


def _wrap_init_device_mesh(original):
    def init_device_mesh(device_type, *args, **kwargs):
        return original("cpu" if device_type == "cuda" else device_type, *args, **kwargs)
    return init_device_mesh


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:     # a core without Megatron-FSDP (core_v0.12)
        return False


def apply_megatron_fsdp_on_cpu(patcher) -> None:
    if _present(f"{PACKAGE}.param_and_grad_buffer"):
        patcher.wrap(SITE, _wrap_preprocessing,
                     reason="gloo has no PREMUL_SUM: Megatron-FSDP's gradients scaled in place, then summed")
    if _present(f"{PACKAGE}.fully_shard"):
        patcher.wrap(MESH_SITE, _wrap_init_device_mesh,
                     reason="Megatron-FSDP's default device mesh (fully_shard without one) on the cpu, not cuda")
