"""Which tokens each CP rank holds, and the batch sharding the training loop calls.

ulysses_cp_algo: contiguous parts. megatron_cp_algo and kvallgather_cp_algo: 2P chunks, rank r
holds r and 2P-1-r (load balanced causal). hybrid_cp_algo (Ulysses degree u, ring size R = P/u):
ring rank j = r // u holds chunks j and 2R-1-j of 2R; Ulysses rank i = r % u takes the i-th
contiguous part of those.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mindspeed.features.context_parallel.groups import check_options
from mindspeed.features.context_parallel.ring import chunk_positions

SEQ_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def check_seq_len(seq_len: int, algo: str, size: int, ulysses_degree: int | None = None) -> None:
    u = check_options(algo, size, ulysses_degree, 1)
    ring = 1 if algo == "ulysses_cp_algo" else size // u
    if algo == "ulysses_cp_algo" and seq_len % size:
        raise ValueError(f"sequence length {seq_len} does not divide by --context-parallel-size {size}")
    if algo != "ulysses_cp_algo" and (seq_len % (2 * ring) or (seq_len // ring) % u):
        raise ValueError(f"sequence length {seq_len} must split into 2x{ring} load-balanced chunks"
                         + (f" whose pairs divide by the Ulysses degree {u}" if u > 1 else "")
                         + f" ({algo}, --context-parallel-size {size}): use a multiple of {2 * size}")


def local_positions(seq_len: int, algo: str, size: int, rank: int, ulysses_degree: int | None = None) -> list[int]:
    """Global positions of CP rank `rank`'s tokens, in local order."""
    check_seq_len(seq_len, algo, size, ulysses_degree)
    if size == 1:
        return list(range(seq_len))
    if algo == "ulysses_cp_algo":
        part = seq_len // size
        return list(range(rank * part, (rank + 1) * part))
    u = check_options(algo, size, ulysses_degree, 1)
    ring = size // u
    pair = chunk_positions(rank // u, ring, seq_len // (2 * ring))
    part = len(pair) // u
    return pair[(rank % u) * part:(rank % u + 1) * part]


def shard_batch(batch: dict, *, algo: str, size: int, rank: int, ulysses_degree: int | None = None,
                seq_dim: int = 1) -> dict:
    """This rank's slice of tokens/labels/loss_mask/position_ids ([b, s], sequence on `seq_dim`).
    attention_mask and everything else stays whole: a general mask is sliced per attention block."""
    if size == 1:
        return dict(batch)
    out = dict(batch)
    seq_len = next(batch[k].shape[seq_dim] for k in SEQ_KEYS if batch.get(k) is not None)
    index = local_positions(seq_len, algo, size, rank, ulysses_degree)
    for key in SEQ_KEYS:
        t = batch.get(key)
        if t is None:
            continue
        if t.shape[seq_dim] != seq_len:
            raise ValueError(f"shard_batch: {key} has {t.shape[seq_dim]} tokens on dim {seq_dim}, "
                             f"the batch has {seq_len}")
        out[key] = t[(slice(None),) * seq_dim + (index,)]
    return out


@dataclass(frozen=True)
class BatchSharding:
    """The batch sharding a CP feature provides the trainers (Session.shard_batch): the run's backend,
    its algorithm, and how to find the CP group (None: the backend's whole world, as the MindSpore
    trainer's is passed in)."""
    backend: Any
    algo: str
    ulysses_degree: int | None = None
    group_provider: Callable | None = None

    def __call__(self, batch: dict, group=None) -> dict:
        comm = self.backend.comm
        if group is None and self.group_provider is not None:
            group = self.group_provider()
        return shard_batch(batch, algo=self.algo, size=comm.world_size(group), rank=comm.rank(group),
                           ulysses_degree=self.ulysses_degree)
