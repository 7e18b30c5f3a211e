"""Capabilities of the mindspore backend per device, declared without importing mindspore.

Measured on mindspore 2.10.0 / CPU: AllReduce(sum), AllGather and Broadcast on the world group
work; AllReduce(max/min), ReduceScatter, AlltoAll, Send/Receive, and AllGather/Broadcast on a
sub-group do not, so comm.py builds them from AllReduce(sum) and marks them emulated here. The fused ops
(ops.rms_norm, swiglu, rotary_position_embedding, flash_attention_score, ring_attention_update,
moe_token_permute/unpermute) are Ascend-only: on CPU every kernel runs the MindSpore reference.

The "ascend" column is declared from MindSpore's documentation and is not run here:
VERIFIED_DEVICES lists the columns the test suite runs on this machine.
"""
from mindspeed.backends.base import Cap, Level, kernel_levels

DEVICES = ["cpu", "ascend"]
VERIFIED_DEVICES = ("cpu",)

# kernels with a MindSpore fused op per device (KernelsAPI method names, as in the torch catalog)
FAST_KERNELS = {
    # moe_token_permute takes top-k indices, not a routing map: the reference serves moe_permute
    "ascend": {"rms_norm", "swiglu", "rope", "attention", "ring_attention_update", "gmm"},
    "cpu": set(),
}


# why a cell is what it is (shown by tests and docs; the matrix only needs the level)
NOTES = {
    "cpu": {
        Cap.BF16_COMPUTE: ("bf16 parameters, activations and gradients; MindSpore 2.10's CPU kernels have no "
                           "bf16 MatMul, BatchMatMul, Gather, Softmax, Sigmoid, Exp, Sqrt, ReduceSum, LayerNorm or "
                           "Assign: those ops compute in fp32 on upcast inputs and round their output to bf16, op "
                           "by op (its traced graphs lack bf16 Reshape and AddN); its CPU collectives take no "
                           "bf16: bf16 tensors travel as fp32"),
        Cap.ALL_REDUCE: "sum native; max/min/avg emulated (gather via AllReduce, then reduce)",
        Cap.ALL_GATHER: "world group native; sub-groups emulated via AllReduce of a zero-padded buffer",
        Cap.BROADCAST: "world group native; sub-groups emulated via AllReduce",
        Cap.REDUCE_SCATTER: "emulated: AllReduce(sum) then keep this rank's slice",
        Cap.ALL_TO_ALL: "emulated: every rank's tensor gathered via AllReduce, own chunks kept",
        Cap.SEND_RECV: "emulated: collective exchange via AllReduce; all group ranks must call it together",
        Cap.DISTRIBUTED_OPTIMIZER: ("reduce-scatter of the gradients and all-gather of the updated slices "
                                    "over DP: both emulated via AllReduce(sum)"),
        Cap.HOST_OFFLOAD: "host and device memory are the same: a copy, no saving",
        Cap.MOE: ("the trainer's own MoE layer (training/mindspore/moe.py, PyNative); expert parallelism "
                  "exchanges tokens with ALL_TO_ALL (emulated here)"),
        Cap.ASYNC_COMM: ("all_reduce and world-group all_gather: mint.distributed's async_op (measured to "
                         "progress while the caller works); reduce_scatter and sub-group all_gather: the "
                         "AllReduce emulation started asynchronously"),
    },
    "ascend": {},
}


def verified(device: str) -> bool:
    """True when the test suite runs this device's column on the CPU-only CI machine."""
    return device in VERIFIED_DEVICES


def declared(device: str) -> dict:
    if device not in DEVICES:
        raise ValueError(f"mindspore backend has no device {device!r}; known: {', '.join(DEVICES)}")
    N, E, A = Level.NATIVE, Level.EMULATED, Level.ABSENT
    fast = FAST_KERNELS[device]
    caps = kernel_levels(fast)
    on_cpu = device == "cpu"
    caps.update({
        Cap.ALL_REDUCE: N, Cap.SUBGROUPS: N,
        # HCCL has these natively; the CPU collective library lacks them
        Cap.ALL_GATHER: E if on_cpu else N,
        Cap.BROADCAST: E if on_cpu else N,
        Cap.REDUCE_SCATTER: E if on_cpu else N,
        Cap.ALL_TO_ALL: E if on_cpu else N,
        Cap.SEND_RECV: E if on_cpu else N,
        Cap.RNG_STATE: N, Cap.CUSTOM_OP: N, Cap.RECOMPUTE: N, Cap.PEAK_MEMORY: N,
        Cap.BF16_COMPUTE: E if on_cpu else N,    # precision.py: the CPU kernels lack bf16 MatMul, Gather, ...
        Cap.RECOMPUTE_OUTPUT: N,
        Cap.HOST_OFFLOAD: E,
        Cap.ASYNC_COMM: E if on_cpu else N,   # mint.distributed async_op; on CPU partly emulated (NOTES)
        Cap.MEGATRON_CORE: A,            # Megatron-Core is torch code; MSAdapter runs it, not this backend
        Cap.NATIVE_TRAINER: N,
        # the trainer's two-stage 1F1B (training/mindspore/pipeline.py); its transfers are SEND_RECV's
        Cap.PIPELINE_PARALLEL: N,
        # the trainer's MoE layer (training/mindspore/moe.py); its token exchange is ALL_TO_ALL's
        Cap.MOE: N,
        # ZeRO-1 (training/mindspore/distrib_optimizer.py): the trainer's optimizer on this rank's slice
        # between a reduce-scatter and an all-gather, both emulated on CPU (NOTES)
        Cap.DISTRIBUTED_OPTIMIZER: E if on_cpu else N,
        Cap.PROFILER: N,                 # mindspore.profiler (CPU op timeline here; Ascend kernels there)
    })
    return caps
