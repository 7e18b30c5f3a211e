"""Which process groups each CP algorithm talks over, and how the CP ranks are arranged.

A CP group of P ranks (cp rank = position in the group). Hybrid with Ulysses degree u arranges
cp rank = j*u + i: Ulysses groups are u consecutive cp ranks (i = 0..u-1), ring groups take one
rank from each Ulysses group (j = 0..P/u-1), so ring neighbours are u ranks apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

ALGOS = ("ulysses_cp_algo", "megatron_cp_algo", "hybrid_cp_algo", "kvallgather_cp_algo")
# the algorithms whose ranks hold Megatron's 2P load-balanced chunks (rank r: chunks r and 2P-1-r)
CHUNKED = ("megatron_cp_algo", "kvallgather_cp_algo")
# the algorithms whose K/V travel round a ring (--cp-window-size, --use-cp-send-recv-overlap)
RINGS = ("megatron_cp_algo", "hybrid_cp_algo")
MASK_TYPES = ("causal", "general")


@dataclass
class CPGroups:
    algo: str
    size: int                      # P
    rank: int                      # rank in the CP group
    group: Any = None              # the CP group (None = world; kvallgather all-gathers K/V over it)
    ulysses_group: Any = None      # Ulysses part (the CP group for ulysses, a subgroup for hybrid)
    ring_group: Any = None         # ring part (the CP group for megatron, a subgroup for hybrid)
    ulysses_degree: int = 1
    window_size: int = 1           # > 1: double ring, inner rings of this size
    overlap: bool = False          # --use-cp-send-recv-overlap
    fused_merge: bool = False      # ring steps merged by the fused ring_attention_update (the feature applied)
    backend: Any = None            # the run's backend: the collectives and kernels the attention uses

    @property
    def ring_size(self) -> int:
        return self.size // self.ulysses_degree if self.algo == "hybrid_cp_algo" else (
            self.size if self.algo == "megatron_cp_algo" else 1)


def check_options(algo: str, size: int, ulysses_degree: int | None, window_size: int) -> int:
    """Validate algorithm options; returns the effective Ulysses degree."""
    if algo not in ALGOS:
        raise ValueError(f"--context-parallel-algo must be one of {', '.join(ALGOS)}, got {algo!r}")
    if size < 1:
        raise ValueError(f"--context-parallel-size must be >= 1, got {size}")
    u = size if algo == "ulysses_cp_algo" else (1 if algo in CHUNKED else ulysses_degree)
    if algo == "hybrid_cp_algo":
        if not ulysses_degree or ulysses_degree < 1 or size % ulysses_degree:
            raise ValueError(f"--ulysses-degree-in-cp {ulysses_degree} must be >= 1 and divide "
                             f"--context-parallel-size {size} (hybrid_cp_algo)")
    ring = size // u if algo in RINGS else 1
    if window_size < 1 or (algo in RINGS and ring % window_size):
        raise ValueError(f"--cp-window-size {window_size} must be >= 1 and divide the ring size {ring}")
    return u


def hybrid_subgroup_ranks(cp_ranks: Sequence[int], u: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ulysses groups, ring groups) as global ranks, for one CP group's global ranks."""
    p = len(cp_ranks)
    ulysses = [list(cp_ranks[j * u:(j + 1) * u]) for j in range(p // u)]
    ring = [list(cp_ranks[i::u]) for i in range(u)]
    return ulysses, ring


def build_cp_groups(algo: str, *, backend, group=None, all_cp_ranks: Sequence[Sequence[int]] | None = None,
                    ulysses_degree: int | None = None, window_size: int = 1, overlap: bool = False,
                    fused_merge: bool = False) -> CPGroups:
    """CPGroups for this process, over `backend` (the run's). `group` is its CP group (None = the
    world). Hybrid creates subgroups, which every process must do for every CP group in the same
    order: `all_cp_ranks` lists every CP group's global ranks (default: one CP group = the world)."""
    comm = backend.comm
    size, rank = comm.world_size(group), comm.rank(group)
    u = check_options(algo, size, ulysses_degree, window_size)
    cp = CPGroups(algo, size, rank, group, ulysses_degree=u, window_size=window_size, overlap=overlap,
                  fused_merge=fused_merge, backend=backend)
    if algo == "ulysses_cp_algo":
        cp.ulysses_group = group
    elif algo == "megatron_cp_algo":
        cp.ring_group = group
    elif u == 1 or u == size:          # degenerate hybrids: one part is the whole CP group
        cp.ring_group, cp.ulysses_group = (group, None) if u == 1 else (None, group)
    else:
        all_cp_ranks = [list(r) for r in (all_cp_ranks or [list(range(comm.world_size()))])]
        me = comm.rank()
        for ranks in sorted(all_cp_ranks):
            ulysses, ring = hybrid_subgroup_ranks(ranks, u)
            for sub in ulysses:
                g = comm.new_group(sub)
                if me in sub:
                    cp.ulysses_group = g
            for sub in ring:
                g = comm.new_group(sub)
                if me in sub:
                    cp.ring_group = g
        if cp.ulysses_group is None or cp.ring_group is None:
            raise ValueError(f"rank {me} is in none of the CP groups {all_cp_ranks}")
    return cp
