"""Attention layouts (docs/kernels.md) on MindSpore tensors: SBH, BSH, BSND, BNSD <-> [b, n, s, d].

Mirrors mindspeed/backends/torch/kernels/layouts.py so both backends accept the same arguments
and raise the same errors.
"""
from __future__ import annotations

from mindspore import ops

from mindspeed.backends.attention_shapes import value_head_dim  # noqa: F401  (the kernels import it from here)

LAYOUTS = ("SBH", "BSH", "BSND", "BNSD", "TND")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown attention layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return layout


def heads_of(t, layout: str, head_dim: int) -> int:
    if layout in ("SBH", "BSH"):
        if t.shape[-1] % head_dim:
            raise ValueError(f"hidden size {t.shape[-1]} is not a multiple of head dim {head_dim}")
        return t.shape[-1] // head_dim
    return t.shape[1] if layout in ("BNSD", "TND") else t.shape[2]


def head_dim_of(q, layout: str, head_num: int) -> int:
    expected_dims = 3 if layout in ("SBH", "BSH", "TND") else 4
    if q.ndim != expected_dims:
        raise ValueError(f"layout {layout} expects {expected_dims}-d tensors, got shape {tuple(q.shape)}")
    if layout in ("SBH", "BSH"):
        if head_num <= 0 or q.shape[-1] % head_num:
            raise ValueError(f"head_num {head_num} must divide the hidden size {q.shape[-1]}")
        return q.shape[-1] // head_num
    if heads_of(q, layout, q.shape[-1]) != head_num:
        raise ValueError(f"head_num {head_num} does not match the query's {heads_of(q, layout, 1)} heads")
    return q.shape[-1]


def to_bnsd(t, layout: str, head_dim: int):
    if layout == "SBH":
        s, b, h = t.shape
        return t.reshape(s, b, h // head_dim, head_dim).transpose(1, 2, 0, 3)
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, h // head_dim, head_dim).transpose(0, 2, 1, 3)
    if layout == "BSND":
        return t.transpose(0, 2, 1, 3)
    if layout == "BNSD":
        return t
    raise ValueError(f"to_bnsd does not handle layout {layout}")


def from_bnsd(t, layout: str):
    b, n, s, d = t.shape
    if layout == "SBH":
        return t.transpose(2, 0, 1, 3).reshape(s, b, n * d)
    if layout == "BSH":
        return t.transpose(0, 2, 1, 3).reshape(b, s, n * d)
    if layout == "BSND":
        return t.transpose(0, 2, 1, 3)
    if layout == "BNSD":
        return t
    raise ValueError(f"from_bnsd does not handle layout {layout}")


def stats_view(stats, layout: str, out):
    """Softmax stats ([b, n, s], TND: [t, n]) reshaped to broadcast against `out` in `layout`."""
    if layout in ("TND", "BNSD"):
        return stats.expand_dims(-1)
    if layout == "BSND":
        return stats.transpose(0, 2, 1).expand_dims(-1)
    b, n, s = stats.shape
    packed = stats.transpose(2, 0, 1) if layout == "SBH" else stats.transpose(0, 2, 1)
    d = out.shape[-1] // n
    return ops.broadcast_to(packed.expand_dims(-1), packed.shape + (d,)).reshape(out.shape)


def seq_bounds(cu_seqlens, total: int, what: str) -> list:
    if cu_seqlens is None:
        raise ValueError(f"layout TND needs {what} (cumulative sequence ends)")
    values = cu_seqlens.asnumpy().tolist() if hasattr(cu_seqlens, "asnumpy") else cu_seqlens
    ends = [int(e) for e in values]
    if not ends or ends[-1] != total or any(b < a for a, b in zip([0] + ends, ends)):
        raise ValueError(f"{what}={ends} must be non-decreasing cumulative ends finishing at {total} "
                         "(no leading 0)")
    return list(zip([0] + ends[:-1], ends))
