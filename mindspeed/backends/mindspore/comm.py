"""Collectives over mindspore.communication, with the ones a device lacks built from AllReduce.

On CPU MindSpore 2.10 offers AllReduce(sum) on any group and AllGather/Broadcast on the world
group only. Everything else is emulated from AllReduce(sum) of a zero-padded buffer: each rank
writes its tensor into its own slot of a [n, ...] buffer of zeros, the sum is every rank's tensor
(adding zeros is exact), and the wanted collective is a local reduction or slice of it. That costs
n times the bandwidth of the native op and keeps the same semantics (capabilities.py says
`emulated`). Where a group's ranks share one x86-64 host, its AllReduce(sum), AllGather and
Broadcast go through shared memory instead of MCCL (shm_collectives.py: same ops, several times
faster; MINDSPEED_MS_SHM_COLLECTIVES=0 keeps MCCL). On Ascend, HCCL has every op natively.
"""
from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

import mindspore as ms
from mindspore import ops

from mindspeed.backends.base import CommAPI, CommHandle
from mindspeed.backends.mindspore import shm_collectives
from mindspeed.backends.mindspore.autograd import MsAutograd, with_gradient
from mindspeed.backends.mindspore.cluster_start import quicker_heartbeat, scheduler_address, wait_for_scheduler
from mindspeed.backends.mindspore.device import pin_to_cores


@dataclass(frozen=True)
class MsGroup:
    """A process group: MindSpore's group name plus its global ranks in group-rank order."""
    name: str
    ranks: tuple


_CREATED_GROUPS: set = set()
_SHM_GROUPS: dict = {}         # group name -> ShmGroup, process-wide as the groups are
_MCCL_GROUPS: list = []        # this rank's CPU groups left to MCCL (across hosts, or not x86-64)
_PROCS_ON_HOST: dict = {}      # "world" -> how many of the job's processes run on this host


class _Done:
    def wait(self):
        return None


def shared_memory_world():
    """The world group's shared-memory collectives (a ShmGroup) once this process joined a job
    whose processes all share this host and map them; else None. Process-wide, as the groups are."""
    from mindspore.communication import GlobalComm
    return _SHM_GROUPS.get(GlobalComm.WORLD_COMM_GROUP) if GlobalComm.INITED else None


def launched_by_msrun() -> bool:
    """msrun starts a scheduler (MS_ROLE=MS_SCHED) and the workers (MS_WORKER), all running the
    same script; each must join the cluster."""
    return os.environ.get("MS_ROLE") in ("MS_WORKER", "MS_SCHED")


def _bf16_as_fp32(method):
    """MindSpore's CPU collectives take no bf16 (MCCL has no bf16 kernel, and the shared-memory and
    gradient pyfunc ops see numpy arrays, which have no bf16): a bf16 tensor travels as fp32 (its values
    exactly; a sum is rounded to bf16 once, after it) and comes back bf16, its gradient likewise."""
    @functools.wraps(method)
    def run(self, tensor, *args, **kwargs):
        if self.native_all or tensor.dtype != ms.bfloat16:
            return method(self, tensor, *args, **kwargs)
        out = method(self, tensor.astype(ms.float32), *args, **kwargs)
        if isinstance(out, tuple):      # send_recv: (tensor, handle)
            return (out[0].astype(ms.bfloat16),) + out[1:]
        return out.astype(ms.bfloat16)
    return run


class MsComm(CommAPI):
    def __init__(self, device: str):
        self.device = device
        self.native_all = device != "cpu"    # HCCL: every collective on every group
        self._autograd = MsAutograd()
        self._ops = {}
        self._world = None
        self._initialized = False
        if launched_by_msrun():
            self.init()

    # process groups ------------------------------------------------------------------------
    def init(self) -> None:
        """Join the job msrun started (idempotent)."""
        from mindspore.communication import GlobalComm, get_group_size, init
        if not GlobalComm.INITED:
            quicker_heartbeat()
            wait_for_scheduler(scheduler_address())
            init()
        if os.environ.get("MS_ROLE") == "MS_SCHED":
            # the scheduler process only coordinates: once the workers are done, it is too
            sys.exit(0)
        self._initialized = True
        self._world = MsGroup(GlobalComm.WORLD_COMM_GROUP, tuple(range(get_group_size())))
        if self._world.name not in _CREATED_GROUPS and len(self._world.ranks) > 1:
            _CREATED_GROUPS.add(self._world.name)
            self._prepare_cpu_group(self._world)

    @property
    def initialized(self) -> bool:
        return self._initialized

    def world(self) -> MsGroup:
        return self._world if self._world is not None else MsGroup("world", (0,))

    def _group(self, group) -> MsGroup:
        return self.world() if group is None else group

    def rank(self, group=None) -> int:
        if not self._initialized:
            return 0
        from mindspore.communication import get_rank
        g = self._group(group)
        return get_rank() if g.name == self._world.name else g.ranks.index(get_rank())

    def world_size(self, group=None) -> int:
        return len(self._group(group).ranks) if self._initialized else 1

    def new_group(self, ranks) -> MsGroup:
        ranks = tuple(sorted(int(r) for r in ranks))
        if not self._initialized:
            if ranks != (0,):
                raise RuntimeError(f"new_group({list(ranks)}) needs a multi-process job (launch with msrun)")
            return self.world()
        if ranks == self._world.ranks:
            return self._world
        if len(ranks) == 1:          # a group of one needs no communicator: collectives are identity
            return MsGroup(f"mindspeed_self_{ranks[0]}", ranks)
        from mindspore.communication import create_group
        name = "mindspeed_g_" + "_".join(map(str, ranks))
        if name not in _CREATED_GROUPS:     # process-wide: MindSpore refuses a second create_group
            _CREATED_GROUPS.add(name)
            if self.rank() in ranks:
                create_group(name, list(ranks))
                self._prepare_cpu_group(MsGroup(name, ranks))
        return MsGroup(name, ranks)

    def _prepare_cpu_group(self, g: MsGroup) -> None:
        """CPU only; a collective over g's members at g's creation (one gather of each member's host).
        Every group: map a shared-memory segment when every member may use one and all run on this
        host; otherwise g keeps MCCL. The world group also gives each of the job's processes on this
        host its own CPU cores (pin_to_cores)."""
        if self.device != "cpu":
            return
        import numpy as np
        me = g.ranks.index(self.rank())
        rng = np.random.default_rng()
        mine = np.array([shm_collectives.shm_allowed(), shm_collectives.host_id(), os.getpid() % (1 << 24),
                         rng.integers(1 << 24)], np.float32)
        every = self._stack(ms.Tensor(mine), g, me).asnumpy()
        if self._is_world(g):
            here = every[:, 1] == every[me, 1]
            _PROCS_ON_HOST["world"] = int(here.sum())
            pin_to_cores(int(here[:me].sum()), int(here.sum()))
        if not every[:, 0].all() or len(set(every[:, 1].tolist())) != 1:
            _MCCL_GROUPS.append(g)
            return
        path = f"/dev/shm/mindspeed-{int(every[0, 2])}-{int(every[0, 3])}-{g.name}"
        spin = _PROCS_ON_HOST.get("world", len(g.ranks)) <= (os.cpu_count() or 1)
        if me == 0:
            shm = shm_collectives.ShmGroup(path, len(g.ranks), 0, create=True, spin=spin, ranks=g.ranks)
        self.barrier(g)
        if me != 0:
            shm = shm_collectives.ShmGroup(path, len(g.ranks), me, create=False, spin=spin, ranks=g.ranks)
        self.barrier(g)
        if me == 0:
            shm.unlink()        # every member has it mapped: no file is left behind
        _SHM_GROUPS[g.name] = shm
        self._ops = {key: op for key, op in self._ops.items() if key[1] != g.name}   # the setup's MCCL ops

    def set_timeout(self, minutes: float) -> list:
        """How long a rank waits for the others in each collective of its groups (Megatron's
        --distributed-timeout-minutes); returns the groups it cannot bound: those left to MCCL, whose
        collectives take no timeout in MindSpore 2.10."""
        for shm in _SHM_GROUPS.values():
            shm.set_timeout(minutes)
        return list(_MCCL_GROUPS)

    def global_rank(self, group, group_rank: int) -> int:
        return self._group(group).ranks[group_rank]

    def _is_world(self, g: MsGroup) -> bool:
        return g.name == self.world().name

    def _op(self, kind, *key):
        if (kind, *key) not in self._ops:
            shm = _SHM_GROUPS.get(key[0])
            if shm is not None and kind in ("all_reduce_sum", "all_gather", "broadcast"):
                self._ops[(kind, *key)] = shm_collectives.primitive(shm, kind, *key[1:])
                return self._ops[(kind, *key)]
            build = {"all_reduce_sum": lambda g: ops.AllReduce(ops.ReduceOp.SUM, g),
                     "all_reduce_max": lambda g: ops.AllReduce(ops.ReduceOp.MAX, g),
                     "all_reduce_min": lambda g: ops.AllReduce(ops.ReduceOp.MIN, g),
                     "all_gather": lambda g: ops.AllGather(g),
                     "reduce_scatter": lambda g: ops.ReduceScatter(ops.ReduceOp.SUM, g),
                     "broadcast": lambda g, root: ops.Broadcast(root, g)}[kind]
            self._ops[(kind, *key)] = build(*key)
        return self._ops[(kind, *key)]

    # building blocks -------------------------------------------------------------------------
    def _sum(self, tensor, g: MsGroup):
        return self._op("all_reduce_sum", g.name)(tensor)

    # The helpers below take this rank's group rank `me` as an argument (no lookup inside): the
    # differentiable collectives call them from backward functions MindSpore compiles into a graph.
    def _stack(self, tensor, g: MsGroup, me: int):
        """[n, *tensor.shape]: every group rank's tensor, in group-rank order."""
        n = len(g.ranks)
        if self.native_all or self._is_world(g) or g.name in _SHM_GROUPS:
            return self._op("all_gather", g.name)(tensor.contiguous()).reshape((n,) + tuple(tensor.shape))
        return self._sum(_padded(tensor, n, me), g)

    def _gather(self, tensor, dim, g: MsGroup, me: int):
        return _joined(self._stack(tensor, g, me), dim)

    def _scatter_sum(self, tensor, dim, g: MsGroup, me: int):
        if self.native_all:
            moved = ops.moveaxis(tensor, dim, 0).contiguous()
            return ops.moveaxis(self._op("reduce_scatter", g.name)(moved), 0, dim)
        return ops.chunk(self._sum(tensor, g), len(g.ranks), axis=dim)[me]

    @staticmethod
    def _check_divisible(name, tensor, dim, n):
        if tensor.shape[dim] % n:
            raise ValueError(f"{name}: dim {dim} of size {tensor.shape[dim]} does not divide by the group size {n}")

    # CommAPI -------------------------------------------------------------------------------------
    @_bf16_as_fp32
    def all_reduce(self, tensor, op="sum", group=None):
        if op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"all_reduce: unknown op {op!r}; choose sum, avg, max or min")
        g = self._group(group)
        n = self.world_size(g)
        if n == 1:
            return tensor.copy()
        if op in ("sum", "avg"):
            out = self._sum(tensor, g)
            return out / n if op == "avg" else out
        if self.native_all:
            return self._op(f"all_reduce_{op}", g.name)(tensor)
        stacked = self._stack(tensor, g, self.rank(g))
        return stacked.max(axis=0) if op == "max" else stacked.min(axis=0)

    @_bf16_as_fp32
    def all_gather(self, tensor, dim=0, group=None):
        g = self._group(group)
        n = self.world_size(g)
        if n == 1:
            return tensor
        return self._gather(tensor, dim, g, self.rank(g))

    @_bf16_as_fp32
    def reduce_scatter(self, tensor, dim=0, group=None):
        g = self._group(group)
        n = self.world_size(g)
        if n == 1:
            return tensor
        self._check_divisible("reduce_scatter", tensor, dim, n)
        return self._scatter_sum(tensor, dim, g, self.rank(g))

    @_bf16_as_fp32
    def all_to_all(self, tensor, scatter_dim, gather_dim, group=None):
        g = self._group(group)
        n = self.world_size(g)
        if n == 1:
            return tensor
        self._check_divisible("all_to_all", tensor, scatter_dim, n)
        if self.native_all:
            return ops.AlltoAll(n, scatter_dim, gather_dim, g.name)(tensor)
        me = self.rank(g)
        every = ops.unbind(self._stack(tensor, g, me), 0)
        return ops.cat([ops.chunk(src, n, axis=scatter_dim)[me] for src in every], axis=gather_dim)

    @_bf16_as_fp32
    def send_recv(self, send_tensor, dst, src, group=None):
        """Emulated on CPU as a collective: every rank of the group must call it together (the
        ring pattern of context parallelism does)."""
        g = self._group(group)
        if self.world_size(g) == 1:
            return send_tensor, _Done()
        if self.native_all:
            from mindspore.communication import comm_func
            send = comm_func.isend(send_tensor, dst=self.global_rank(g, dst), group=g.name)
            recv = comm_func.irecv(ops.zeros_like(send_tensor), src=self.global_rank(g, src), group=g.name)
            return recv[0], _Both(send, recv[1])
        return self._stack(send_tensor, g, self.rank(g))[src], _Done()

    @_bf16_as_fp32
    def broadcast(self, tensor, src=0, group=None):
        g = self._group(group)
        if self.world_size(g) == 1:
            return tensor.copy()
        if g.name in _SHM_GROUPS:
            return self._op("broadcast", g.name, src)(tensor)
        if self.native_all or self._is_world(g):
            return self._op("broadcast", g.name, self.global_rank(g, src))((tensor,))[0]
        return self._stack(tensor, g, self.rank(g))[src]

    def barrier(self, group=None) -> None:
        if self._initialized:
            self._sum(ms.Tensor([1.0], ms.float32), self._group(group)).asnumpy()

    # asynchronous variants: mindspore.mint.distributed's async_op, which on CPU (2.10) exists
    # for AllReduce and the list form of AllGather; the rest is the emulation above, its
    # AllReduce started asynchronously and the slice / reshape done in wait(). The collective
    # writes into its buffer, so the caller's tensor is copied first (it must stay unchanged).
    def all_reduce_async(self, tensor, op="sum", group=None):
        g = self._group(group)
        if op != "sum" or self.world_size(g) == 1:
            return super().all_reduce_async(tensor, op, group)
        buf = tensor.copy()
        return _Pending(_dist().all_reduce(buf, "sum", g.name, async_op=True), lambda: buf)

    def all_gather_async(self, tensor, dim=0, group=None):
        g = self._group(group)
        n = self.world_size(g)
        if n == 1:
            return super().all_gather_async(tensor, dim, group)
        if self.native_all or self._is_world(g):
            parts = [ops.zeros_like(tensor) for _ in range(n)]
            handle = _dist().all_gather(parts, tensor.contiguous(), g.name, async_op=True)
            return _Pending(handle, lambda: ops.cat(parts, axis=dim))
        buf = _padded(tensor, n, self.rank(g))
        handle = _dist().all_reduce(buf, "sum", g.name, async_op=True)
        return _Pending(handle, lambda: _joined(buf, dim))

    def reduce_scatter_async(self, tensor, dim=0, group=None):
        g = self._group(group)
        n = self.world_size(g)
        if n == 1:
            return super().reduce_scatter_async(tensor, dim, group)
        self._check_divisible("reduce_scatter", tensor, dim, n)
        if self.native_all:
            moved = ops.moveaxis(tensor, dim, 0).contiguous()
            out = ops.zeros((moved.shape[0] // n,) + tuple(moved.shape[1:]), moved.dtype)
            handle = _dist().reduce_scatter_tensor(out, moved, "sum", g.name, async_op=True)
            return _Pending(handle, lambda: ops.moveaxis(out, 0, dim))
        buf, me = tensor.copy(), self.rank(g)
        handle = _dist().all_reduce(buf, "sum", g.name, async_op=True)
        return _Pending(handle, lambda: ops.chunk(buf, n, axis=dim)[me])

    # differentiable variants: backward is the adjoint collective ----------------------------------
    @_bf16_as_fp32
    def all_to_all_autograd(self, tensor, scatter_dim, gather_dim, group=None):
        op = self._autograd.custom_op(
            lambda ctx, x: self.all_to_all(x, scatter_dim, gather_dim, group),
            lambda ctx, dy: (self.all_to_all(dy, gather_dim, scatter_dim, group),))
        return op(tensor)

    # The four below are the tensor-parallel layers' collectives. They carry their gradient with
    # with_gradient (a primitive's bprop), not a Cell's bprop, so they stay right inside a
    # jit-traced forward, where MindSpore's own AllReduce backward would sum the gradient again
    # (doubling TP gradients) and AllGather's (a ReduceScatter) has no CPU kernel.
    @_bf16_as_fp32
    def all_gather_autograd(self, tensor, dim=0, group=None):
        g = self._group(group)
        if self.world_size(g) == 1:
            return tensor

        me = self.rank(g)

        def backward(dy):      # defs, not lambdas, throughout: MindSpore parses their source
            return self._scatter_sum(dy, dim, g, me)
        return with_gradient(lambda x: self.all_gather(x, dim, g), tensor, backward, ("all_gather", g.name, dim))

    @_bf16_as_fp32
    def reduce_scatter_autograd(self, tensor, dim=0, group=None):
        g = self._group(group)
        if self.world_size(g) == 1:
            return tensor

        me = self.rank(g)

        def backward(dy):
            return self._gather(dy, dim, g, me)
        return with_gradient(lambda x: self.reduce_scatter(x, dim, g), tensor, backward,
                             ("reduce_scatter", g.name, dim))

    # tensor-parallel region markers (Megatron's copy_to / reduce_from), used by the trainer
    @_bf16_as_fp32
    def copy_to_region(self, tensor, group=None):
        """Forward identity; backward sums the gradient over the group."""
        g = self._group(group)
        if self.world_size(g) == 1:
            return tensor

        def backward(dy):
            return self._sum(dy, g)
        return with_gradient(lambda x: x, tensor, backward, ("copy_to", g.name))

    @_bf16_as_fp32
    def reduce_from_region(self, tensor, group=None):
        """Forward sums over the group; backward identity."""
        g = self._group(group)
        if self.world_size(g) == 1:
            return tensor

        def backward(dy):
            return dy
        return with_gradient(lambda x: self._sum(x, g), tensor, backward, ("reduce_from",))


def _padded(tensor, n: int, me: int):
    """[n, *tensor.shape]: zeros except slot `me`; its AllReduce(sum) is every rank's tensor."""
    zero = ops.zeros_like(tensor)
    return ops.stack([tensor if i == me else zero for i in range(n)])


def _joined(stacked, dim: int):
    """[n, ...] -> the n slices concatenated along dim (an all-gather's result)."""
    return ops.cat(list(ops.unbind(stacked, 0)), axis=dim)


def _dist():
    import mindspore.mint.distributed as dist
    return dist


class _Pending(CommHandle):
    """A collective in flight; wait() finishes it and returns finish()'s result."""

    def __init__(self, handle, finish):
        self.handle, self.finish = handle, finish

    def wait(self):
        self.handle.wait()
        return self.finish()


class _Both:
    def __init__(self, *handles):
        self.handles = handles

    def wait(self):
        for h in self.handles:
            if h is not None:
                h.wait()
