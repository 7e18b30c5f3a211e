"""Attention shape rules both backends' kernels share (they read `.shape` only: no framework here)."""
from __future__ import annotations


def value_head_dim(k, v, layout: str, head_dim: int) -> int:
    """The head size of `v`, which may differ from q's and k's `head_dim` (multi-latent attention):
    in the packed-H layouts v's hidden size over k's head count."""
    if layout not in ("SBH", "BSH"):
        return v.shape[-1]
    if k.shape[-1] % head_dim:
        raise ValueError(f"hidden size {k.shape[-1]} is not a multiple of head dim {head_dim}")
    heads = k.shape[-1] // head_dim
    if v.shape[-1] % heads:
        raise ValueError(f"value hidden size {v.shape[-1]} is not a multiple of the {heads} key/value heads")
    return v.shape[-1] // heads
