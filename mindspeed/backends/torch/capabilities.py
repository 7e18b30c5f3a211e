"""Capabilities of the torch backend per device, declared without importing torch."""
from mindspeed.backends.base import Cap, Level, kernel_levels
from mindspeed.backends.torch.kernels.catalog import FAST_PATHS

DEVICES = ["cpu", "cuda", "npu"]



def declared(device: str) -> dict:
    if device not in DEVICES:
        raise ValueError(f"torch backend has no device {device!r}; known: {', '.join(DEVICES)}")
    native, N, E, A = FAST_PATHS[device], Level.NATIVE, Level.EMULATED, Level.ABSENT
    caps = kernel_levels(native)
    caps.update({
        # gloo / nccl / hccl all provide these collectives natively
        Cap.ALL_REDUCE: N, Cap.ALL_GATHER: N, Cap.REDUCE_SCATTER: N, Cap.ALL_TO_ALL: N,
        Cap.SEND_RECV: N, Cap.BROADCAST: N, Cap.SUBGROUPS: N,
        Cap.RNG_STATE: N, Cap.BF16_COMPUTE: N,
        Cap.CUSTOM_OP: N, Cap.RECOMPUTE: N, Cap.RECOMPUTE_OUTPUT: N, Cap.PEAK_MEMORY: N,
        # on cpu "host" memory is the same memory: offload is a copy, honest but no saving
        Cap.HOST_OFFLOAD: E if device == "cpu" else N,
        Cap.ASYNC_COMM: N,   # gloo / nccl / hccl work handles (async_op=True)
        Cap.MEGATRON_CORE: N, Cap.NATIVE_TRAINER: A,
        Cap.PIPELINE_PARALLEL: N, Cap.DISTRIBUTED_OPTIMIZER: N, Cap.MOE: N, Cap.PROFILER: N,
    })
    return caps
