"""Which kernels have a fast path on which device (framework-free, read by the support matrix).

A kernel without a fast path on a device still runs, through its reference implementation:
the matrix shows it as `emulated` there.
"""
from mindspeed.backends.base import KERNEL_NAMES as KERNELS

FAST_PATHS = {
    # torch_npu ops (npu.py); matmul_add_fp32 is an in-place addmm there, dropout_add_layer_norm composed;
    # grouped_matmul_add_fp32 runs the reference (per-group in-place addmm) until an NPU measures its op
    "npu": set(KERNELS) - {"dropout_add_layer_norm", "grouped_matmul_add_fp32"},
    # torch's memory-efficient CUDA attention (cuda.py), measured on a GPU against the reference
    # (tests_extend/benchmarks/bench_cuda_attention.py, docs/gpu.md); the others run the reference
    "cuda": {"attention"},
    # cpu: fused C++ (rms_norm, swiglu, rope) and torch's CPU flash attention, measured faster than
    # the reference and than torch.compile of it (tests_extend/benchmarks/bench_kernels.py); in-place
    # grouped GEMM and embedding-bag token permutation, at the reference's GEMM / memory-bound speed
    # (1.08x, ~1.0x) with no zero-filled full-size buffers. The others run the reference.
    "cpu": {"rms_norm", "swiglu", "rope", "attention", "gmm", "moe_permute", "moe_unpermute"},
}
