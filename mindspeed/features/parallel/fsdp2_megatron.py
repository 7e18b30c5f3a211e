"""The torch hook of 'torch-fsdp2' (fsdp2.py): Megatron-Core 0.16's own TorchFullyShardedDataParallel,
made to run on the run's device and with the torch this project pins, through three patches:

- its device mesh is built for "cuda" whatever the device: here for the run's (cpu: gloo, which has
  all_gather_into_tensor and reduce_scatter_tensor in torch 2.13);
- Megatron-Core's finalize_model_grads calls finish_grad_sync(force_all_reduce=...), which the
  wrapper's base class does not take (FSDP2 has reduce-scattered during backward: nothing is left);
- dist_checkpointing pairs optimizer parameters with the model's sharded tensors by the identity of
  each DTensor's local tensor, which torch 2.13's DTensor.to_local() no longer keeps for parameters
  (a fresh view each call): the local tensor itself is handed back, as before;
- the SwiGLU fc1 checkpoint factory splits a local tensor into its gate and up halves, but an FSDP2
  shard is a run of rows of [gate; up] (all gate or all up at an even data-parallel size): it is
  saved as that run, at its place in the checkpoint's global [gate; up] layout;
- with --bf16, its fully_shard gets FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 gradient
  reduction; upstream's param_dtype / reduce_dtype): the wrapper passes none, and FSDP2 refuses a
  parameter group of mixed dtypes (the trainer's norms keep fp32 weights). The shards stay fp32 and
  are the optimizer's master weights (no second fp32 copy as Float16Optimizer keeps).

`wrap_chunks` is how the built-in trainer wraps its model chunks (Megatron-LM's training.py does the
same with --use-torch-fsdp2)."""
from __future__ import annotations

MODULE = "megatron.core.distributed.torch_fully_sharded_data_parallel"


class _MeshOnDevice:
    """DeviceMesh.from_group with the run's device type in place of the wrapper's "cuda"."""

    def __init__(self, device_type: str):
        self.device_type = device_type

    def from_group(self, group, _device_type, *args, **kwargs):
        from torch.distributed import DeviceMesh
        return DeviceMesh.from_group(group, self.device_type, *args, **kwargs)


def _finish_grad_sync(self, force_all_reduce: bool = False) -> None:
    """Nothing to finish: FSDP2 reduce-scattered each layer's gradients during backward."""


def _local_tensor(tensor):
    from megatron.core.utils import HAVE_DTENSOR
    if HAVE_DTENSOR:
        from torch.distributed.tensor import DTensor
        if isinstance(tensor, DTensor):
            return tensor._local_tensor
    return tensor


def _swiglu_shard(original_sh_ten, sharded_offsets, singleton_local_shards: bool = False):
    """The checkpoint entry of an FSDP2 shard of a SwiGLU fc1 (rows of one TP shard's [gate; up])."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor
    axis = len(sharded_offsets)
    dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    frag = original_sh_ten.axis_fragmentations[axis]
    index = original_sh_ten.global_offset[axis] // original_sh_ten.local_shape[0]
    tp_rank, piece, half, tp = index // dp, index % dp, dp // 2, frag // dp
    up = piece >= half
    within = tp_rank * half + piece % half          # the shard's place among the gate (or up) rows
    if singleton_local_shards:
        key, offset = f"{original_sh_ten.key}_{'v' if up else 'w'}", (axis, within, tp * half)
    else:
        key, offset = original_sh_ten.key, (axis, within + (tp * half if up else 0), frag)
    return ShardedTensor.from_rank_offsets(key, original_sh_ten.data, *sharded_offsets, offset,
                                           replica_id=original_sh_ten.replica_id, prepend_axis_num=axis)


def install_device_mesh(patcher, device: str) -> None:
    """The wrapper's device mesh on the run's device (also what Megatron's own FSDP2 unit tests need,
    which build the wrapper without the flag: mindspeed/pytest_plugin.py)."""
    patcher.replace(f"{MODULE}.DeviceMesh", _MeshOnDevice(device),
                    reason="torch-fsdp2: the wrapper's device mesh on the run's device, not always cuda")


def _mixed_precision_shard(module, **kwargs):
    """fully_shard with bf16 compute and fp32 gradient reduce-scatter over fp32 shards."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return fully_shard(module, mp_policy=policy, **kwargs)


def install(patcher, device: str, bf16: bool = False) -> None:
    install_device_mesh(patcher, device)
    if bf16:
        patcher.replace(f"{MODULE}.fully_shard", _mixed_precision_shard,
                        reason="torch-fsdp2 --bf16: FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 reduction), "
                               "which the wrapper does not pass")
    patcher.replace(f"{MODULE}.TorchFullyShardedDataParallel.finish_grad_sync", _finish_grad_sync,
                    reason="torch-fsdp2: finalize_model_grads passes force_all_reduce, which the wrapper lacks")
    patcher.replace("megatron.core.dist_checkpointing.optimizer.to_local_if_dtensor", _local_tensor,
                    reason="torch-fsdp2: optimizer state paired with the model's shards by the local tensor's "
                           "identity (torch 2.13's to_local() returns a fresh view of a parameter)")
    patcher.replace("megatron.core.transformer.mlp.apply_swiglu_sharded_factory", _swiglu_shard, aliases="megatron",
                    reason="torch-fsdp2: an FSDP2 shard of SwiGLU's fc1 is rows of [gate; up], saved at their place")


def wrap_chunks(args, config, chunks: list) -> list:
    """Each model chunk in Megatron-Core's TorchFullyShardedDataParallel, as Megatron-LM's get_model does."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
    from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
        TorchFullyShardedDataParallelConfig)
    ddp_config = TorchFullyShardedDataParallelConfig(reshard_after_forward=args.torch_fsdp2_reshard_after_forward)
    if args.bf16:       # fp32 shards: MixedPrecisionPolicy casts them to bf16 for each layer's compute
        chunks = [chunk.float() for chunk in chunks]
    return [TorchFullyShardedDataParallel(config, ddp_config, chunk) for chunk in chunks]


def optimizer_config(args, config):
    """With --bf16 the sharded parameters are fp32 master weights: Megatron's fp32 optimizer steps them."""
    import dataclasses
    import torch
    if not args.bf16:
        return config
    return dataclasses.replace(config, bf16=False, params_dtype=torch.float32)
