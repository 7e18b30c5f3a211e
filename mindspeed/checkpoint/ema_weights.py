"""--use-ema for a saved run: a torch_dist checkpoint's EMA of the weights (--optimizer-selection
fused_ema_adamw's optimizer state 'ema_params', which Megatron-Core saves as
optimizer.state.ema_params.<the parameter's key>, sharded as the parameter) loaded into the model's
parameters, in place of its weights. What mindspeed.generate and mindspeed.evaluate run with --use-ema."""
from __future__ import annotations

import dataclasses

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from mindspeed.checkpoint import scan
from mindspeed.checkpoint.scan import iteration_dir
from mindspeed.checkpoint.torch_dist import _model_keys, _unwrap, is_neutral, read_tracker
from mindspeed.errors import CheckpointError

PREFIX = "optimizer.state.ema_params."


def load_ema_weights(root: str, chunks, step: int | None = None) -> int:
    """The EMA of each parameter the checkpoint holds one for into the model (cast to the parameter's
    dtype); returns how many tensors were loaded. A checkpoint without any is refused in one line."""
    path = iteration_dir(root, read_tracker(root, step))
    if scan.is_legacy(path) or is_neutral(path):
        raise CheckpointError(f"--use-ema reads the EMA of the weights from a torch_dist checkpoint; {path} is "
                              "in another format: save with --ckpt-format torch_dist, or drop --use-ema")
    saved = dist_checkpointing.load_tensors_metadata(path)
    state = {}
    for key, chunk in zip(_model_keys(chunks), chunks):
        state[key] = {}
        for name, value in _unwrap(chunk).sharded_state_dict().items():
            # a parameter as one tensor, or as a factory of several (SwiGLU's fc1: its two halves)
            if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and PREFIX + value.key in saved:
                # read as saved (fp32), into a buffer of the parameter's shape
                buffer = torch.empty(value.data.shape, dtype=saved[PREFIX + value.key].dtype,
                                     device=value.data.device)
                dtype = {"dtype": buffer.dtype} if isinstance(value, ShardedTensor) else {}
                state[key][name] = dataclasses.replace(value, key=PREFIX + value.key, data=buffer, **dtype)
    count = sum(len(model) for model in state.values())
    if not count:
        raise CheckpointError(f"checkpoint {path} holds no EMA of the weights (saved without --optimizer-selection "
                              "fused_ema_adamw, with --no-save-optim, or by the distributed optimizer, whose "
                              "EMA shards are not keyed by parameter): drop --use-ema")
    loaded = dist_checkpointing.load(state, path)
    with torch.no_grad():
        for key, chunk in zip(_model_keys(chunks), chunks):
            params = dict(_unwrap(chunk).state_dict(keep_vars=True))
            for name, ema in loaded[key].items():
                params[name].copy_(ema)        # every name came from this chunk's own parameters
    return count
