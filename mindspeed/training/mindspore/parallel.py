"""Tensor/context/data-parallel process groups for the MindSpore trainer, on the backend's comm.

Rank layout follows Megatron: tensor-parallel ranks are adjacent, then context-parallel, then
data-parallel, then pipeline stages (rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank).
Every rank creates every group in the same order (collective group creation needs that).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelState:
    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    tp_group: object
    dp_group: object
    sequence_parallel: bool = False
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: object = None
    all_cp_ranks: list = field(default_factory=list)   # every CP group's global ranks
    tp_linear: object = None     # a feature's TP linears (--use-ascend-coc's CocLinears), else layers.py's
    main_grads: object = None    # --(gemm-)gradient-accumulation-fusion's fp32 weight gradients (main_grad.py)
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: object = None
    ep_size: int = 1             # expert parallelism: the experts split over ep_size adjacent ranks (DP
                                 # ranks; with --moe-tp-extend-ep the TP x EP block, TP fastest)
    ep_rank: int = 0
    ep_group: object = None
    edp_group: object = None     # the ranks holding the same experts (expert gradients are reduced there,
    edp_size: int = 1            # the distributed optimizer shards their state there): Megatron's expt_dp,
    edp_rank: int = 0            # world / (EP x TP) ranks with --moe-tp-extend-ep, world / EP without

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def build_parallel_state(comm, tp_size: int, sequence_parallel: bool = False, cp_size: int = 1,
                         pp_size: int = 1, ep_size: int = 1, tp_extend_ep: bool = False) -> ParallelState:
    """tp_extend_ep (--moe-tp-extend-ep): the experts are spread over the TP x EP block of ranks
    (Megatron-Core's expert grid with expert TP 1 and expert parallelism TP * EP)."""
    world, rank = comm.world_size(), comm.rank()
    if tp_extend_ep and (cp_size, pp_size) != (1, 1):
        raise ValueError("--moe-tp-extend-ep here spreads the experts over TP x EP at CP = PP = 1")
    if ep_size > 1 and not tp_extend_ep and (tp_size, cp_size, pp_size) != (1, 1, 1):
        raise ValueError("expert parallelism here splits the data-parallel ranks only (TP = CP = PP = 1)")
    if world % (tp_size * cp_size * pp_size):
        raise ValueError(f"world size {world} is not divisible by tensor ({tp_size}) x context ({cp_size}) "
                         f"x pipeline ({pp_size}) parallel sizes")
    stage = world // pp_size
    dp_size = stage // (tp_size * cp_size)
    at = lambda p, d, c, t: p * stage + (d * cp_size + c) * tp_size + t
    inner = [(d, c, t) for d in range(dp_size) for c in range(cp_size) for t in range(tp_size)]
    groups = {}
    tp_lists = [[at(p, d, c, t) for t in range(tp_size)] for p in range(pp_size) for d in range(dp_size)
                for c in range(cp_size)]
    cp_lists = [[at(p, d, c, t) for c in range(cp_size)] for p in range(pp_size) for d in range(dp_size)
                for t in range(tp_size)]
    dp_lists = [[at(p, d, c, t) for d in range(dp_size)] for p in range(pp_size) for c in range(cp_size)
                for t in range(tp_size)]
    pp_lists = [[at(p, d, c, t) for p in range(pp_size)] for d, c, t in inner]
    for kind, lists in (("tp", tp_lists), ("cp", cp_lists), ("dp", dp_lists), ("pp", pp_lists)):
        for ranks in lists:
            g = comm.new_group(ranks)
            if rank in ranks:
                groups[kind] = g
    local = rank % stage
    tp_rank, cp_rank, dp_rank = local % tp_size, (local // tp_size) % cp_size, local // (tp_size * cp_size)
    ps = ParallelState(tp_size, dp_size, tp_rank, dp_rank, groups["tp"], groups["dp"],
                       sequence_parallel and tp_size > 1, cp_size, cp_rank, groups["cp"], cp_lists,
                       pp_size=pp_size, pp_rank=rank // stage, pp_group=groups["pp"])
    spread = ep_size * (tp_size if tp_extend_ep else 1)
    return _with_expert_groups(comm, ps, spread) if spread > 1 else ps


def _with_expert_groups(comm, ps: ParallelState, ep_size: int) -> ParallelState:
    """Megatron's expert layout with expert TP 1 at CP = PP = 1 (order tp-ep-dp): EP groups are
    blocks of ep_size adjacent ranks (at TP > 1, under --moe-tp-extend-ep, a block holds whole TP
    groups: EP rank = ep_rank * TP + tp_rank), expert-data-parallel groups the ranks ep_size apart."""
    world, rank = comm.world_size(), comm.rank()
    if world % ep_size:
        raise ValueError(f"world size {world} is not divisible by expert parallel size {ep_size}")
    ep_lists = [list(range(b, b + ep_size)) for b in range(0, world, ep_size)]
    edp_lists = [list(range(j, world, ep_size)) for j in range(ep_size)]
    for kind, lists in (("ep", ep_lists), ("edp", edp_lists)):
        for ranks in lists:
            g = comm.new_group(ranks)
            if rank in ranks:
                setattr(ps, f"{kind}_group", g)
    ps.ep_size, ps.ep_rank = ep_size, rank % ep_size
    ps.edp_size, ps.edp_rank = world // ep_size, rank // ep_size
    return ps


def stage_layer_counts(num_layers: int, pp_size: int, layer_list=None, first=None, last=None) -> list[int]:
    """Transformer layers per pipeline stage, as Megatron splits them: --num-layer-list when given,
    else --decoder-first/last-pipeline-num-layers with the rest even over the middle stages, else even."""
    if layer_list:
        return list(layer_list)
    if pp_size == 1:
        return [num_layers]
    if first is None and last is None:
        return [num_layers // pp_size] * pp_size
    middle = pp_size - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    counts = [rest // middle] * middle if middle else []
    return ([first] if first is not None else []) + counts + ([last] if last is not None else [])
