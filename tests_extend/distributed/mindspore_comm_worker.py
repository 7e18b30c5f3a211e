"""msrun worker: every collective of the mindspore backend (native and emulated) and the
gradients of the differentiable variants, checked against numpy on each rank, on the world group
and, with 4 workers, on real sub-groups: pairs {0,1},{2,3} and strided pairs {0,2},{1,3} (the
shapes of hybrid context parallelism's Ulysses and ring groups).
Usage: msrun ... mindspore_comm_worker.py OUT_DIR"""
import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import end_worker, write_result  # noqa: E402

SHAPE = (4, 12)           # both dims divide by 2 and by 4
SUBGROUPS = {"pairs": [[0, 1], [2, 3]], "strided": [[0, 2], [1, 3]]}


def data(rank, shape=SHAPE):
    return (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 100 * rank)


def group_checks(comm, group, members, tag, out):
    """Every collective on `group` (global ranks `members`, in group-rank order) against numpy;
    records `tag/<check>` in out."""
    import mindspore as ms
    r = members.index(comm.rank())               # this process's rank in the group
    n = len(members)
    assert comm.rank(group) == r and comm.world_size(group) == n, (comm.rank(group), r, comm.world_size(group), n)
    x = ms.Tensor(data(comm.rank()))
    every = [data(i) for i in members]

    def check(name, got, want):
        np.testing.assert_allclose(got.asnumpy(), want, rtol=0, atol=0, err_msg=f"{tag}/{name}")
        out[f"{tag}/{name}"] = True

    check("all_reduce_sum", comm.all_reduce(x, "sum", group), sum(every))
    check("all_reduce_avg", comm.all_reduce(x, "avg", group), sum(every) / n)
    check("all_reduce_max", comm.all_reduce(x, "max", group), np.maximum.reduce(every))
    check("all_reduce_min", comm.all_reduce(x, "min", group), np.minimum.reduce(every))
    check("all_gather_dim0", comm.all_gather(x, 0, group), np.concatenate(every, 0))
    check("all_gather_dim1", comm.all_gather(x, 1, group), np.concatenate(every, 1))
    check("reduce_scatter_dim0", comm.reduce_scatter(x, 0, group), np.split(sum(every), n, 0)[r])
    check("reduce_scatter_dim1", comm.reduce_scatter(x, 1, group), np.split(sum(every), n, 1)[r])
    check("all_to_all_0_1", comm.all_to_all(x, 0, 1, group),
          np.concatenate([np.split(e, n, 0)[r] for e in every], 1))
    check("all_to_all_1_0", comm.all_to_all(x, 1, 0, group),
          np.concatenate([np.split(e, n, 1)[r] for e in every], 0))
    recv, handle = comm.send_recv(x, dst=(r + 1) % n, src=(r - 1) % n, group=group)
    handle.wait()
    check("send_recv_ring", recv, every[(r - 1) % n])
    check("broadcast", comm.broadcast(x, src=n - 1, group=group), every[n - 1])

    # the async variants, all in flight at once (as --use-ascend-coc starts them), waited in
    # reverse order; the caller's tensor is left as it was
    pending = [("all_reduce_async", comm.all_reduce_async(x, "sum", group), sum(every)),
               ("all_gather_async_dim0", comm.all_gather_async(x, 0, group), np.concatenate(every, 0)),
               ("all_gather_async_dim1", comm.all_gather_async(x, 1, group), np.concatenate(every, 1)),
               ("reduce_scatter_async_dim0", comm.reduce_scatter_async(x, 0, group), np.split(sum(every), n, 0)[r]),
               ("reduce_scatter_async_dim1", comm.reduce_scatter_async(x, 1, group), np.split(sum(every), n, 1)[r])]
    for name, handle, want in reversed(pending):
        check(name, handle.wait(), want)
    check("async_input_unchanged", x, every[r])

    # gradients of the differentiable variants: d/dx sum(op(x) * w_r) with a rank-dependent w
    def grad_of(fn, w_np):
        w = ms.Tensor(w_np)
        return ms.grad(lambda t: (fn(t) * w).sum())(x)

    rows, cols = SHAPE
    w_gather = [np.full((rows * n, cols), i + 1.0, np.float32) for i in range(n)]   # group rank i's weight
    check("grad_all_gather", grad_of(lambda t: comm.all_gather_autograd(t, 0, group), w_gather[r]),
          np.split(sum(w_gather), n, 0)[r])
    w_rs = [np.full((rows // n, cols), 10.0 * (i + 1), np.float32) for i in range(n)]
    check("grad_reduce_scatter", grad_of(lambda t: comm.reduce_scatter_autograd(t, 0, group), w_rs[r]),
          np.concatenate(w_rs, 0))
    w_a2a = [np.arange(rows // n * cols * n, dtype=np.float32).reshape(rows // n, cols * n) + 7 * i for i in range(n)]
    # y_r = cat_s chunk_r(x_s) along dim 1, so dL/dx_r = cat over dst of the dst's weight block r
    check("grad_all_to_all", grad_of(lambda t: comm.all_to_all_autograd(t, 0, 1, group), w_a2a[r]),
          np.concatenate([np.split(w_a2a[d], n, 1)[r] for d in range(n)], 0))
    w_ones = np.ones(SHAPE, np.float32)
    check("grad_copy_to_region_sums", grad_of(lambda t: comm.copy_to_region(t, group), w_ones * (r + 1)),
          w_ones * sum(i + 1 for i in range(n)))
    check("grad_reduce_from_region_identity",
          grad_of(lambda t: comm.reduce_from_region(t, group), w_ones * (r + 1)), w_ones * (r + 1))

    # the tensor-parallel ones again inside a traced graph (the trainer's graph mode), where only
    # a primitive's bprop counts: the same gradients
    from mindspeed.training.mindspore.tracing import traced

    def traced_grad_of(fn, w_np):
        w = ms.Tensor(w_np)
        return ms.grad(traced(lambda t: (fn(t) * w).sum()))(x)
    check("traced_grad_all_gather", traced_grad_of(lambda t: comm.all_gather_autograd(t, 0, group), w_gather[r]),
          np.split(sum(w_gather), n, 0)[r])
    check("traced_grad_reduce_scatter",
          traced_grad_of(lambda t: comm.reduce_scatter_autograd(t, 0, group), w_rs[r]), np.concatenate(w_rs, 0))
    check("traced_grad_copy_to_region_sums",
          traced_grad_of(lambda t: comm.copy_to_region(t, group), w_ones * (r + 1)),
          w_ones * sum(i + 1 for i in range(n)))
    check("traced_grad_reduce_from_region_identity",
          traced_grad_of(lambda t: comm.reduce_from_region(t, group), w_ones * (r + 1)), w_ones * (r + 1))
    check("traced_reduce_from_region_value", traced(lambda t: comm.reduce_from_region(t, group))(x), sum(every))


def checks(backend):
    comm = backend.comm
    r, n = comm.rank(), comm.world_size()
    out = {}
    group_checks(comm, None, list(range(n)), "world", out)
    assert comm.new_group(list(range(n))) is comm.world()            # the world, by its ranks

    import mindspore as ms
    x = ms.Tensor(data(r))
    self_group = comm.new_group([r])                                 # a group of one: identity
    for name, got in (("all_gather", comm.all_gather(x, 0, self_group)),
                      ("all_reduce", comm.all_reduce(x, "sum", self_group))):
        np.testing.assert_array_equal(got.asnumpy(), data(r), err_msg=f"group_of_one/{name}")
        out[f"group_of_one/{name}"] = True

    if n == 4:
        # every rank creates every group, in the same order (MindSpeed's rule for new_group)
        for tag, blocks in SUBGROUPS.items():
            groups = [comm.new_group(b) for b in blocks]
            mine = next(i for i, b in enumerate(blocks) if r in b)
            assert not comm._is_world(groups[mine])                 # a real sub-group, not the world
            group_checks(comm, groups[mine], blocks[mine], tag, out)
    comm.barrier()
    return out


def main(out_dir):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    backend = MindSporeBackend("cpu")
    rank = backend.comm.rank()
    try:
        done = checks(backend)
        from mindspeed.backends.mindspore import comm as ms_comm
        shm = {name: os.path.exists(group.path) for name, group in ms_comm._SHM_GROUPS.items()}
        write_result(out_dir, rank, {"ok": True, "world": backend.comm.world_size(), "checks": done,
                                     "shm_groups": sorted(shm), "shm_files_left": [n for n, left in shm.items() if left]})
    except Exception:
        write_result(out_dir, rank, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main(sys.argv[1])
    end_worker()
