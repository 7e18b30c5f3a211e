"""Affinity compute: one feature per fused-kernel flag (optimization level 1).

Each module holds a feature's Megatron-Core hook (module specs or config fields where Megatron
offers them, the patch manager where it does not); the computation is always
`get_backend().kernels.<name>`, so the same hook serves npu, cuda and cpu.
"""
