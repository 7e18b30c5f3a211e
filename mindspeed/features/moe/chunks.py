"""How --moe-alltoall-overlap-comm cuts each expert's block of permuted rows into chunks: shared by
its Megatron-Core hook (alltoall_overlap.py) and the MindSpore trainer's MoE layer."""
from __future__ import annotations

CHUNKS = 2     # pieces per expert block: 2 already hides a chunk's all-to-all behind the other's GEMMs


def piece(n: int, c: int, chunks: int) -> tuple[int, int]:
    """[start, end) of part c of a block of n rows cut into `chunks` near-equal parts."""
    base, extra = divmod(n, chunks)
    start = c * base + min(c, extra)
    return start, start + base + (1 if c < extra else 0)
