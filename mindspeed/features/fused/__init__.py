"""Affinity compute: one feature per fused-kernel flag (optimization level 1).

Each module holds a feature's Megatron-Core hook (module specs or config fields where Megatron
offers them, the patch manager where it does not); the computation is always
`kernels.<name>` of the run's backend (ctx.backend at apply, handed to what the hook installs), so
the same hook serves npu, cuda and cpu.
"""
