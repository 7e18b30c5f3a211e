"""Attention tensor layouts (docs/kernels.md) and their conversion to and from [b, n, s, d].

SBH and BSH pack heads into the last dim ([s, b, n*d], [b, s, n*d]); BSND, BNSD name every dim;
TND is packed variable-length sequences [t, n, d] with cumulative sequence ends (no leading 0).
Conversions return views where possible, so the fast paths avoid copies.
"""
from __future__ import annotations

import torch

from mindspeed.backends.attention_shapes import value_head_dim  # noqa: F401  (the kernels import it from here)

LAYOUTS = ("SBH", "BSH", "BSND", "BNSD", "TND")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown attention layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return layout


def heads_of(t: torch.Tensor, layout: str, head_dim: int) -> int:
    """Number of heads of a tensor in `layout` (head_dim needed for the packed-H layouts)."""
    if layout in ("SBH", "BSH"):
        if t.shape[-1] % head_dim:
            raise ValueError(f"hidden size {t.shape[-1]} is not a multiple of head dim {head_dim}")
        return t.shape[-1] // head_dim
    return t.shape[1] if layout in ("BNSD", "TND") else t.shape[2]


def head_dim_of(q: torch.Tensor, layout: str, head_num: int) -> int:
    expected_dims = 3 if layout in ("SBH", "BSH", "TND") else 4
    if q.dim() != expected_dims:
        raise ValueError(f"layout {layout} expects {expected_dims}-d tensors, got shape {tuple(q.shape)}")
    if layout in ("SBH", "BSH"):
        if head_num <= 0 or q.shape[-1] % head_num:
            raise ValueError(f"head_num {head_num} must divide the hidden size {q.shape[-1]}")
        return q.shape[-1] // head_num
    if heads_of(q, layout, q.shape[-1]) != head_num:
        raise ValueError(f"head_num {head_num} does not match the query's {heads_of(q, layout, 1)} heads")
    return q.shape[-1]


def resize_heads(t: torch.Tensor, layout: str, head_dim: int, size: int) -> torch.Tensor:
    """Each head of `t` (head size `head_dim`) cut to its first `size` channels, or zero channels
    appended up to `size`: how a kernel that takes one head size for q, k and v serves an unequal v."""
    if layout in ("SBH", "BSH"):
        heads = t.unflatten(-1, (t.shape[-1] // head_dim, head_dim))
        return torch.nn.functional.pad(heads, (0, size - head_dim)).flatten(-2)
    return torch.nn.functional.pad(t, (0, size - head_dim))


def to_bnsd(t: torch.Tensor, layout: str, head_dim: int) -> torch.Tensor:
    """View `t` (any layout but TND) as [b, n, s, d]."""
    if layout == "SBH":
        s, b, h = t.shape
        return t.view(s, b, h // head_dim, head_dim).permute(1, 2, 0, 3)
    if layout == "BSH":
        b, s, h = t.shape
        return t.view(b, s, h // head_dim, head_dim).permute(0, 2, 1, 3)
    if layout == "BSND":
        return t.permute(0, 2, 1, 3)
    if layout == "BNSD":
        return t
    raise ValueError(f"to_bnsd does not handle layout {layout}")


def from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of to_bnsd (returns a contiguous tensor in `layout`)."""
    b, n, s, d = t.shape
    if layout == "SBH":
        return t.permute(2, 0, 1, 3).reshape(s, b, n * d)
    if layout == "BSH":
        return t.permute(0, 2, 1, 3).reshape(b, s, n * d)
    if layout == "BSND":
        return t.permute(0, 2, 1, 3).contiguous()
    if layout == "BNSD":
        return t.contiguous()
    raise ValueError(f"from_bnsd does not handle layout {layout}")


def stats_view(stats: torch.Tensor, layout: str, out: torch.Tensor) -> torch.Tensor:
    """Softmax stats ([b, n, s], TND: [t, n]) reshaped to broadcast against `out` in `layout`."""
    if layout == "TND":
        return stats.unsqueeze(-1)                                    # [t, n, 1]
    if layout == "BNSD":
        return stats.unsqueeze(-1)                                    # [b, n, s, 1]
    if layout == "BSND":
        return stats.permute(0, 2, 1).unsqueeze(-1)                   # [b, s, n, 1]
    b, n, s = stats.shape
    packed = stats.permute(2, 0, 1) if layout == "SBH" else stats.permute(0, 2, 1)   # [s,b,n] / [b,s,n]
    return packed.unsqueeze(-1).expand(*packed.shape, out.shape[-1] // n).reshape(out.shape)


def seq_bounds(cu_seqlens, total: int, what: str) -> list[tuple[int, int]]:
    """[(start, end)] from cumulative sequence ends without a leading 0 (TND)."""
    if cu_seqlens is None:
        raise ValueError(f"layout TND needs {what} (cumulative sequence ends)")
    ends = [int(e) for e in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    if not ends or ends[-1] != total or any(b < a for a, b in zip([0] + ends, ends)):
        raise ValueError(f"{what}={ends} must be non-decreasing cumulative ends finishing at {total} "
                         "(no leading 0)")
    return list(zip([0] + ends[:-1], ends))
