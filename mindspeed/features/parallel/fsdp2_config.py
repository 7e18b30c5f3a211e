"""Upstream MindSpeed's `--fsdp2-config-path` YAML, key by key: what Megatron-Core's FSDP2 wrapper
(TorchFullyShardedDataParallel) can honour is mapped onto the run's flags, the rest is refused in one
line that says what to use instead. Read before any work (the feature's validate)."""
from __future__ import annotations

import os

from mindspeed.features.base import FeatureConfigError

DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16",
               "fp16": "fp16", "float16": "fp16"}
# keys Megatron-Core's wrapper has no counterpart for: why, and what instead
REFUSED = {
    "sub_modules_to_wrap": "Megatron-Core's wrapper shards each transformer layer, the embedding and the rotary "
                           "embedding; leave the key out",
    "ignored_modules": "every module is sharded by Megatron-Core's wrapper; leave the key out",
    "recompute_modules": "use Megatron's --recompute-granularity / --recompute-method (the wrapper prefetches "
                         "around them)",
    "offload_to_cpu": "not implemented with FSDP2; use --swap-optimizer for host-held optimizer states",
}


def data_parallel_size(args) -> int:
    """The host's, or (a `check` before any launch) from WORLD_SIZE as the launcher sets it."""
    if args.data_parallel_size is not None:
        return args.data_parallel_size
    model_parallel = (args.tensor_model_parallel_size or 1) * (args.pipeline_model_parallel_size or 1) \
        * (args.context_parallel_size or 1)
    return max(int(os.environ.get("WORLD_SIZE", "1")) // model_parallel, 1)


def _params_dtype(args) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _dtype_key(key: str, value, args) -> dict:
    """param_dtype is the run's (--bf16: FSDP2's MixedPrecisionPolicy); gradients reduce in fp32 always."""
    name = DTYPE_NAMES.get(str(value).lower())
    if key == "reduce_dtype":
        if name != "fp32":
            raise FeatureConfigError(f"reduce_dtype: {value}: gradients are reduce-scattered in fp32 (as DDP's "
                                     "grad_reduce_in_fp32); set reduce_dtype: fp32")
        return {}
    here = _params_dtype(args)
    if name != here:
        raise FeatureConfigError(
            f"param_dtype: {value} differs from the run's compute dtype ({here}); set param_dtype: {here} "
            "(or change --bf16)")
    return {}


def _check_key(key: str, value, args) -> dict:
    """The host values one key sets ({} where it only has to agree with the run)."""
    dp = data_parallel_size(args)
    if key in REFUSED and value not in (None, False, [], 0):
        raise FeatureConfigError(f"{key}: {REFUSED[key]}")
    if key == "sharding_size":
        if value != dp and value != -1:
            raise FeatureConfigError(f"sharding_size: {value}: Megatron-Core's wrapper shards over the whole "
                                     f"data-parallel group ({dp} ranks); set sharding_size: {dp} (hybrid "
                                     "sharding groups are not implemented)")
        return {}
    if key == "reshard_after_forward":
        if not isinstance(value, bool):
            raise FeatureConfigError(f"reshard_after_forward: {value}: give true or false")
        return {"torch_fsdp2_reshard_after_forward": value}
    if key in ("param_dtype", "reduce_dtype"):
        return _dtype_key(key, value, args)
    if key == "cast_forward_inputs" and value is not True:
        raise FeatureConfigError("cast_forward_inputs: false: the wrapper casts nothing (inputs arrive in the "
                                 "parameters' dtype); leave it true")
    if key == "num_to_forward_prefetch" and value not in (0, None):
        raise FeatureConfigError(f"num_to_forward_prefetch: {value}: the wrapper keeps FSDP2's own prefetch; "
                                 "leave it 0")
    if key in REFUSED or key in ("cast_forward_inputs", "num_to_forward_prefetch", "pin_memory"):
        return {}       # the defaults: what the wrapper does anyway (pin_memory acts only with offload_to_cpu)
    raise FeatureConfigError(f"{key}: not an FSDP2 option (upstream's keys: sharding_size, reshard_after_forward, "
                             "param_dtype, reduce_dtype, cast_forward_inputs, ...)")


def read_config(path: str, args) -> dict:
    """The host values `path` sets; FeatureConfigError for a missing file, a bad YAML or a refused key."""
    import yaml
    if not os.path.isfile(path):
        raise FeatureConfigError(f"--fsdp2-config-path {path}: no such file")
    with open(path, encoding="utf-8") as f:
        try:
            config = yaml.safe_load(f) or {}
        except yaml.YAMLError as err:
            raise FeatureConfigError(f"--fsdp2-config-path {path}: not YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise FeatureConfigError(f"--fsdp2-config-path {path}: expected key: value lines")
    values = {}
    for key, value in config.items():
        try:
            values.update(_check_key(str(key), value, args))
        except FeatureConfigError as err:
            raise FeatureConfigError(f"--fsdp2-config-path {path}: {err}") from None
    return values
