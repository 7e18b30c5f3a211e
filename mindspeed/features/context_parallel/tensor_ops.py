"""The two tensor moves CP needs that the backend interface does not name, written with tensor
methods that torch and MindSpore tensors share (shape, reshape, unsqueeze, new_zeros, arithmetic,
repeat_interleave), so the CP logic stays framework-free."""
from __future__ import annotations


def join_seq(first, second):
    """cat([first, second], dim 0). There is no concat in the interface: stack the two through a
    [2, 1, ...] 0/1 weight (x*1 + y*0 is exact for finite values) and fold the new dim into dim 0.
    The gradient splits back to each part exactly."""
    if tuple(first.shape[1:]) != tuple(second.shape[1:]):
        raise ValueError(f"join_seq: trailing shapes differ: {tuple(first.shape)} vs {tuple(second.shape)}")
    if first.shape[0] != second.shape[0]:
        raise ValueError("join_seq: parts must have equal length along dim 0")
    pick_first = first.new_zeros((2,) + (1,) * first.dim())
    pick_first[0] = 1
    stacked = first.unsqueeze(0) * pick_first + second.unsqueeze(0) * (1 - pick_first)
    return stacked.reshape((2 * first.shape[0],) + tuple(first.shape[1:]))


def repeat_heads(x, head_dim: int, repeats: int):
    """[s, b, n*d] -> [s, b, n*repeats*d], each head repeated in place (GQA mapping kept: query
    head h still reads kv head h // group)."""
    if repeats == 1:
        return x
    s, b, h = x.shape
    return x.reshape(s, b, h // head_dim, head_dim).repeat_interleave(repeats, 2).reshape(
        s, b, h * repeats)
