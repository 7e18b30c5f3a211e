"""msrun worker of bench_coc.py --backend mindspore: the TP=2 MLP of the MindSpore trainer
(training/mindspore/layers.py column_parallel -> row_parallel) forward + backward, in one run:

- no overlap, traced: the layers as the trainer runs them without --use-ascend-coc (a graph);
- no overlap, PyNative: the same layers op by op;
- coc 2 / 4 chunks: the layers through CoC (PyNative: what --use-ascend-coc runs);
- compute alone / communication alone: the GEMMs fwd+bwd, the collectives back to back;
- async probe: one all-reduce of the layer output's size started async while the compute-alone
  GEMMs run, then waited, against the same two done one after the other.

The configurations take turns step by step, a barrier before each; rank 0 writes the medians.
Usage: msrun ... bench_coc_mindspore.py OUT_DIR SEQ HIDDEN FFN STEPS"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import end_worker, write_result  # noqa: E402


def main(out_dir, seq, hidden, ffn, steps):
    import mindspore as ms
    import numpy as np

    from mindspeed.backends import set_backend
    from mindspeed.features.parallel.coc_mindspore import CocLinears
    from mindspeed.training.mindspore.layers import column_parallel, linear, row_parallel
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.tracing import traced
    backend = set_backend("mindspore", "cpu")        # what the CoC linears run over
    comm = backend.comm
    rng = np.random.RandomState(comm.rank())
    rows, part = seq // 2, ffn // 2
    w1 = ms.Parameter(ms.Tensor(rng.normal(0, 0.02, (part, hidden)).astype(np.float32)), name="w1")
    w2 = ms.Parameter(ms.Tensor(rng.normal(0, 0.02, (hidden, part)).astype(np.float32)), name="w2")
    results = {}
    for sp in (True, False):
        ps = build_parallel_state(comm, 2, sp)
        x = ms.Tensor(rng.rand(rows if sp else seq, 1, hidden).astype(np.float32))

        def mlp(x):
            return row_parallel(backend, ps, column_parallel(backend, ps, x, w1), w2).sum()

        def run(grad_fn, coc_chunks=None):
            def step():
                ps.tp_linear = CocLinears(backend, coc_chunks) if coc_chunks else None
                _, grads = grad_fn(x)
                grads[0].asnumpy()
                ps.tp_linear = None
            return step
        plain = ms.value_and_grad(mlp, None, weights=[w1, w2])
        graph = ms.value_and_grad(traced(mlp), None, weights=[w1, w2])
        xf = ms.Tensor(rng.rand(seq, 1, hidden).astype(np.float32))
        compute_grad = ms.value_and_grad(lambda x: linear(linear(x, w1), w2).sum(), None, weights=[w1, w2])

        def compute():
            compute_grad(xf)[1][0].asnumpy()
        full, local = ms.Tensor(rng.rand(seq, 1, hidden).astype(np.float32)), x[:rows]

        def communicate():
            if sp:      # fwd: gather x, reduce-scatter y; bwd: gather dy, reduce-scatter dx (+ x for dW)
                outs = [comm.all_gather(local, 0, ps.tp_group) for _ in range(3)]
                outs += [comm.reduce_scatter(full, 0, ps.tp_group) for _ in range(2)]
            else:       # fwd: all-reduce y; bwd: all-reduce dx
                outs = [comm.all_reduce(full, "sum", ps.tp_group) for _ in range(2)]
            outs[-1].asnumpy()

        def sequential():
            comm.all_reduce(full, "sum", ps.tp_group).asnumpy()
            compute()

        def overlapped():
            handle = comm.all_reduce_async(full, "sum", ps.tp_group)
            compute()
            handle.wait().asnumpy()
        fns = {"no overlap, traced": run(graph), "no overlap, PyNative": run(plain),
               "coc 2 chunks": run(plain, 2), "coc 4 chunks": run(plain, 4), "compute alone": compute,
               "communication alone": communicate, "probe: all-reduce then GEMMs": sequential,
               "probe: all-reduce async under GEMMs": overlapped}
        times = {k: [] for k in fns}
        for i in range(steps + 1):
            for name, fn in fns.items():
                comm.barrier()
                t = time.perf_counter()
                fn()
                if i:                         # step 0 warms up (and compiles the trace)
                    times[name].append(time.perf_counter() - t)
        results.update({f"{sp}/{k}": statistics.median(v) for k, v in times.items()})
    write_result(out_dir, comm.rank(), results)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:6]))
    end_worker()
