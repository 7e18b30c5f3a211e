"""A tensor move CP needs that the backend interface does not name, written with tensor methods
that torch and MindSpore tensors share (shape, reshape, repeat_interleave), so the CP logic stays
framework-free. (Joining and splitting are the interface's: backend.tensors.cat / split.)"""
from __future__ import annotations


def repeat_heads(x, head_dim: int, repeats: int):
    """[s, b, n*d] -> [s, b, n*repeats*d], each head repeated in place (GQA mapping kept: query
    head h still reads kv head h // group)."""
    if repeats == 1:
        return x
    s, b, h = x.shape
    return x.reshape(s, b, h // head_dim, head_dim).repeat_interleave(repeats, 2).reshape(
        s, b, h * repeats)
