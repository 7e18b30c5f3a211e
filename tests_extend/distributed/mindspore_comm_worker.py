"""msrun worker: every collective of the mindspore backend (native and emulated) and the
gradients of the differentiable variants, checked against numpy on each rank.
Usage: msrun ... mindspore_comm_worker.py OUT_DIR"""
import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import write_result  # noqa: E402


def data(rank, shape=(4, 6)):
    return (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 100 * rank)


def checks(backend):
    import mindspore as ms
    comm = backend.comm
    r, n = comm.rank(), comm.world_size()
    x = ms.Tensor(data(r))
    every = [data(i) for i in range(n)]
    sub = comm.new_group(list(range(n)))          # the world group, by its ranks
    self_group = comm.new_group([r])               # a group of one
    out = {}

    def check(name, got, want):
        np.testing.assert_allclose(got.asnumpy(), want, rtol=0, atol=0, err_msg=name)
        out[name] = True

    check("all_reduce_sum", comm.all_reduce(x), sum(every))
    check("all_reduce_avg", comm.all_reduce(x, "avg"), sum(every) / n)
    check("all_reduce_max", comm.all_reduce(x, "max"), np.maximum.reduce(every))
    check("all_reduce_min", comm.all_reduce(x, "min"), np.minimum.reduce(every))
    check("all_gather_dim0", comm.all_gather(x, 0), np.concatenate(every, 0))
    check("all_gather_dim1", comm.all_gather(x, 1), np.concatenate(every, 1))
    check("reduce_scatter_dim0", comm.reduce_scatter(x, 0), np.split(sum(every), n, 0)[r])
    check("reduce_scatter_dim1", comm.reduce_scatter(x, 1), np.split(sum(every), n, 1)[r])
    check("all_to_all_0_1", comm.all_to_all(x, 0, 1),
          np.concatenate([np.split(e, n, 0)[r] for e in every], 1))
    check("all_to_all_1_0", comm.all_to_all(x, 1, 0),
          np.concatenate([np.split(e, n, 1)[r] for e in every], 0))
    recv, handle = comm.send_recv(x, dst=(r + 1) % n, src=(r - 1) % n)
    handle.wait()
    check("send_recv_ring", recv, every[(r - 1) % n])
    check("broadcast_world", comm.broadcast(x, src=1), every[1])
    check("group_of_one_all_gather", comm.all_gather(x, 0, self_group), every[r])
    check("group_of_one_all_reduce", comm.all_reduce(x, "sum", self_group), every[r])
    # a group other than the world's own handle exercises the sub-group (emulated) path
    emulated = comm.new_group([0, 1]) if n == 2 else sub
    fake_sub = type(emulated)("mindspeed_g_test_sub", emulated.ranks)
    from mindspore.communication import create_group
    create_group(fake_sub.name, list(fake_sub.ranks))
    check("subgroup_all_gather", comm.all_gather(x, 0, fake_sub), np.concatenate(every, 0))
    check("subgroup_broadcast", comm.broadcast(x, src=0, group=fake_sub), every[0])
    check("subgroup_all_to_all", comm.all_to_all(x, 0, 1, fake_sub),
          np.concatenate([np.split(e, n, 0)[r] for e in every], 1))
    comm.barrier()

    # gradients of the differentiable variants: d/dx sum(op(x) * w_r) with a rank-dependent w
    def grad_of(fn, w_np):
        w = ms.Tensor(w_np)
        return ms.grad(lambda t: (fn(t) * w).sum())(x)

    w_gather = np.stack([np.full((4 * n, 6), i + 1.0, np.float32) for i in range(n)])  # rank i's weight
    check("grad_all_gather", grad_of(lambda t: comm.all_gather_autograd(t, 0), w_gather[r]),
          np.split(sum(w_gather), n, 0)[r])
    w_rs = [np.full((4 // n, 6), 10.0 * (i + 1), np.float32) for i in range(n)]
    check("grad_reduce_scatter", grad_of(lambda t: comm.reduce_scatter_autograd(t, 0), w_rs[r]),
          np.concatenate(w_rs, 0))
    w_a2a = [np.arange(4 // n * 6 * n, dtype=np.float32).reshape(4 // n, 6 * n) + 7 * i for i in range(n)]
    # y_r = cat_s chunk_r(x_s) along dim 1, so dL/dx_r = cat over dst of the dst's weight block r
    check("grad_all_to_all", grad_of(lambda t: comm.all_to_all_autograd(t, 0, 1), w_a2a[r]),
          np.concatenate([np.split(w_a2a[d], n, 1)[r] for d in range(n)], 0))
    w_ones = np.ones((4, 6), np.float32)
    check("grad_copy_to_region_sums", grad_of(lambda t: comm.copy_to_region(t), w_ones * (r + 1)),
          w_ones * sum(i + 1 for i in range(n)))
    check("grad_reduce_from_region_identity", grad_of(lambda t: comm.reduce_from_region(t), w_ones * (r + 1)),
          w_ones * (r + 1))
    return out


def main(out_dir):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    backend = MindSporeBackend("cpu")
    rank = backend.comm.rank()
    try:
        write_result(out_dir, rank, {"ok": True, "world": backend.comm.world_size(), "checks": checks(backend)})
    except Exception:
        write_result(out_dir, rank, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main(sys.argv[1])
