"""Collectives over torch.distributed (gloo on cpu, nccl on cuda, hccl on npu)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from mindspeed.backends.base import CommAPI, CommHandle, Completed

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class _Done:
    def wait(self):
        return None


class _Handles:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()


class _Pending(CommHandle):
    """A torch.distributed work handle (gloo runs it on its own thread: the caller's compute goes on);
    `finish` turns the filled buffers into the result once the work is done."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self):
        self.work.wait()
        return self.finish()


def _chunks(tensor, n, dim):
    return [c.contiguous() for c in torch.chunk(tensor, n, dim=dim)]


class TorchComm(CommAPI):
    def rank(self, group=None) -> int:
        return dist.get_rank(group) if dist.is_initialized() else 0

    def world_size(self, group=None) -> int:
        return dist.get_world_size(group) if dist.is_initialized() else 1

    def new_group(self, ranks):
        return dist.new_group(list(ranks))

    def global_rank(self, group, group_rank: int) -> int:
        return dist.get_global_rank(group, group_rank) if group is not None else group_rank

    def all_reduce(self, tensor, op="sum", group=None):
        out = tensor.clone()
        if op == "avg":
            dist.all_reduce(out, dist.ReduceOp.SUM, group=group)
            return out / self.world_size(group)
        dist.all_reduce(out, _OPS[op], group=group)
        return out

    def all_gather(self, tensor, dim=0, group=None):
        n = self.world_size(group)
        if n == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(n)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, tensor, dim=0, group=None):
        n = self.world_size(group)
        if n == 1:
            return tensor
        if tensor.shape[dim] % n:
            raise ValueError(f"reduce_scatter: dim {dim} of size {tensor.shape[dim]} does not divide by {n}")
        parts = _chunks(tensor, n, dim)
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=group)
        return out

    def all_to_all(self, tensor, scatter_dim, gather_dim, group=None):
        n = self.world_size(group)
        if n == 1:
            return tensor
        if tensor.shape[scatter_dim] % n:
            raise ValueError(f"all_to_all: dim {scatter_dim} of size {tensor.shape[scatter_dim]} "
                             f"does not divide by the group size {n}")
        inputs = _chunks(tensor, n, scatter_dim)
        outputs = [torch.empty_like(c) for c in inputs]
        dist.all_to_all(outputs, inputs, group=group)
        return torch.cat(outputs, dim=gather_dim)

    def send_recv(self, send_tensor, dst, src, group=None):
        # gloo refuses strided buffers: receive into a contiguous one whatever the sender's layout
        recv = torch.empty_like(send_tensor, memory_format=torch.contiguous_format)
        ops = [dist.P2POp(dist.isend, send_tensor.contiguous(), self.global_rank(group, dst), group),
               dist.P2POp(dist.irecv, recv, self.global_rank(group, src), group)]
        return recv, _Handles(dist.batch_isend_irecv(ops))

    def broadcast(self, tensor, src=0, group=None):
        out = tensor.clone()
        dist.broadcast(out, self.global_rank(group, src), group=group)
        return out

    def barrier(self, group=None) -> None:
        if dist.is_initialized():
            dist.barrier(group=group)

    # asynchronous variants -------------------------------------------------------------------
    def all_reduce_async(self, tensor, op="sum", group=None):
        if op == "avg":
            out = tensor.clone()
            n = self.world_size(group)
            return _Pending(dist.all_reduce(out, dist.ReduceOp.SUM, group=group, async_op=True), lambda: out / n)
        out = tensor.clone()
        return _Pending(dist.all_reduce(out, _OPS[op], group=group, async_op=True), lambda: out)

    def all_gather_async(self, tensor, dim=0, group=None):
        n = self.world_size(group)
        if n == 1:
            return Completed(tensor)
        parts = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(n)]
        work = dist.all_gather(parts, tensor.contiguous(), group=group, async_op=True)
        return _Pending(work, lambda: torch.cat(parts, dim=dim))

    def reduce_scatter_async(self, tensor, dim=0, group=None):
        n = self.world_size(group)
        if n == 1:
            return Completed(tensor)
        if tensor.shape[dim] % n:
            raise ValueError(f"reduce_scatter: dim {dim} of size {tensor.shape[dim]} does not divide by {n}")
        parts = _chunks(tensor, n, dim)
        out = torch.empty_like(parts[0])
        return _Pending(dist.reduce_scatter(out, parts, group=group, async_op=True), lambda: out)

    def all_to_all_v_async(self, tensor, output_splits, input_splits, group=None):
        if self.world_size(group) == 1:
            return Completed(tensor)
        out = tensor.new_empty((int(sum(output_splits)),) + tuple(tensor.shape[1:]))
        work = dist.all_to_all_single(out, tensor.contiguous(), [int(s) for s in output_splits],
                                      [int(s) for s in input_splits], group=group, async_op=True)
        return _Pending(work, lambda: out)

    # differentiable variants -----------------------------------------------------------------
    def all_to_all_autograd(self, tensor, scatter_dim, gather_dim, group=None):
        return _AllToAll.apply(tensor, scatter_dim, gather_dim, group, self)

    def all_gather_autograd(self, tensor, dim=0, group=None):
        return _AllGather.apply(tensor, dim, group, self)

    def reduce_scatter_autograd(self, tensor, dim=0, group=None):
        return _ReduceScatter.apply(tensor, dim, group, self)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, comm):
        ctx.args = (scatter_dim, gather_dim, group, comm)
        return comm.all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim, group, comm = ctx.args
        return comm.all_to_all(grad.contiguous(), gather_dim, scatter_dim, group), None, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, comm):
        ctx.args = (dim, group, comm)
        return comm.all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        dim, group, comm = ctx.args
        return comm.reduce_scatter(grad.contiguous(), dim, group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, comm):
        ctx.args = (dim, group, comm)
        return comm.reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        dim, group, comm = ctx.args
        return comm.all_gather(grad.contiguous(), dim, group), None, None, None
