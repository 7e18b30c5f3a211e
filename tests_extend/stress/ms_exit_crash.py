"""Reproducer for MindSpore's crash at exit (docs/native-crash.md), with no MindSpeed code in the workers.

Each msrun worker joins the cluster (`mindspore.communication.init()`), runs a few CPU ops, optionally
pins itself and every thread to one core (as MindSpeed's MINDSPEED_MS_CPU_AFFINITY=1 did), and ends
as Python ends: MindSpore's atexit handler finalizes the cluster node and clears its runtime.
`--recipe comm` does instead, in plain MindSpore and numpy, what the launch that crashed most often
(`test_mindspore_comm.py`'s 4 workers) does besides MindSpeed's own checks: MCCL sub-groups (pairs
and strided pairs), world and sub-group collectives, `mint.distributed`'s asynchronous ones in flight
together, a shared-memory segment every rank maps, read and written by `pyfunc` Custom ops with a
bprop, and gradients through them in PyNative and in a traced (`ms.jit`) function.

    python tests_extend/stress/ms_exit_crash.py --launches 30 --workers 2 --pin
    python tests_extend/stress/ms_exit_crash.py --launches 50 --workers 4 --recipe comm --perturb 0

Not a pytest test. Each launch prints its exit code and verdict; a crashed launch's logs are kept.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from ms_native_crash import NATIVE_CRASH_SIGNS, ROOT       # this script's folder is on sys.path

# the exit crash's other form: std::system_error thrown out of the handler
CRASH_SIGNS = (*NATIVE_CRASH_SIGNS, "terminate called")


def worker(args) -> None:
    import numpy as np
    import mindspore as ms
    from mindspore import ops
    from mindspore.communication import init, get_rank
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init()
    if args.pin:
        core = {sorted(os.sched_getaffinity(0))[get_rank() % len(os.sched_getaffinity(0))]}
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), core)
            except OSError:
                pass
    w = ms.Tensor(np.random.rand(64, 64).astype(np.float32))
    x = ms.Tensor(np.random.rand(8, 64).astype(np.float32))
    for _ in range(args.steps):
        x = ops.tanh(ops.matmul(x, w))
    print(f"rank {get_rank()} done {float(x.sum()):.3f}", flush=True)


PARTS = ("groups", "sync", "async", "shm", "pyfunc", "traced")


def _parts(value: str) -> list[str]:
    """--without's comma list; a name that is not a part is refused, not ignored."""
    names = [x for x in value.split(",") if x]
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(unknown)}; the parts: {', '.join(PARTS)}")
    return names


def comm_worker(args) -> None:
    import numpy as np
    import mindspore as ms
    from mindspore import mint, ops
    from mindspore.communication import create_group, get_group_size, get_rank, init
    from multiprocessing import resource_tracker, shared_memory
    use = set(PARTS) - set(args.without)
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    init()
    rank, world = get_rank(), get_group_size()
    groups = [None]           # None: the world
    for tag, sets in (("pairs", [[0, 1], [2, 3]]), ("strided", [[0, 2], [1, 3]])):
        for members in sets:
            if "groups" in use and world == 4 and rank in members:
                name = f"{tag}_{members[0]}_{members[1]}"
                create_group(name, members)
                groups.append(name)
    x = ms.Tensor(np.arange(48, dtype=np.float32).reshape(4, 12) + 100 * rank)
    world_ar = ops.AllReduce()
    segments, slots = [], np.zeros(1024, np.float32)
    if "shm" in use:          # a segment per rank that every rank maps, as shared-memory collectives do
        prefix = f"ms_exit_{os.environ.get('MS_SCHED_PORT', '0')}_"
        segments.append(shared_memory.SharedMemory(name=prefix + str(rank), create=True, size=4096))
        world_ar(ms.Tensor(np.ones(1, np.float32))).asnumpy()        # every segment exists now
        for r in range(world):
            if r != rank:
                segments.append(shared_memory.SharedMemory(name=prefix + str(r)))
                resource_tracker.unregister(segments[-1]._name, "shared_memory")  # pylint: disable=protected-access
        slots = np.ndarray((1024,), np.float32, buffer=segments[0].buf)

    def through_segment(a):
        slots[:a.size] = a.ravel()
        return slots[:a.size].reshape(a.shape).copy()

    def bprop(a, out, dout):
        return (dout * 2,)
    via_pyfunc = (ops.Custom(through_segment, lambda s: s, lambda t: t, func_type="pyfunc", bprop=bprop)
                  if "pyfunc" in use else ops.abs)
    w = ms.Parameter(ms.Tensor(np.random.rand(12, 12).astype(np.float32) * 0.1), name="w")

    def loss(t):
        return (ops.tanh(via_pyfunc(ops.matmul(t, w))) * 3).sum()
    traced = ms.jit(ms.value_and_grad(loss, None, weights=[w]))
    for _ in range(args.steps):
        if "sync" in use:
            for g in groups:
                ops.AllReduce(**({} if g is None else {"group": g}))(x).asnumpy()
            ops.AllGather()(x).asnumpy()          # world only: sub-group AllGather fails on CPU
            ops.Broadcast(0)((x,))[0].asnumpy()
        if "async" in use:
            dist = mint.distributed
            pending = [dist.all_reduce(x.copy(), "sum", g, async_op=True) for g in groups]
            parts = [ms.Tensor(np.zeros((4, 12), np.float32)) for _ in range(world)]
            pending.append(dist.all_gather(parts, x, None, async_op=True))
            for handle in reversed(pending):
                handle.wait()
        ms.value_and_grad(loss, None, weights=[w])(x)
        if "traced" in use:
            traced(x)
    world_ar(ms.Tensor(np.ones(1, np.float32))).asnumpy()            # nobody unmaps before all are done
    del slots
    for seg in segments:
        seg.close()
    if segments:
        segments[0].unlink()
    print(f"rank {rank} done", flush=True)


def launches(args) -> int:
    sys.path.insert(0, ROOT)
    from mindspeed.net import free_port
    bindir = os.path.dirname(sys.executable)       # msrun starts `python` from PATH
    env = dict(os.environ, PYTHONFAULTHANDLER="1", GLOG_v="3", PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    if args.perturb != "0":
        env.update(MALLOC_CHECK_="3", MALLOC_PERTURB_=args.perturb)
    inner = [os.path.abspath(__file__), "--as-worker", "--steps", str(args.steps), "--recipe", args.recipe,
             "--without", ",".join(args.without),
             *(["--pin"] if args.pin else [])]
    crashes = 0
    for k in range(args.launches):
        log_dir = tempfile.mkdtemp(prefix="ms_exit_")
        cmd = [os.path.join(bindir, "msrun"), f"--worker_num={args.workers}", f"--local_worker_num={args.workers}",
               f"--master_port={free_port()}", "--join=True", f"--log_dir={log_dir}", "--cluster_time_out=60", *inner]
        started = time.time()
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        logs = p.stdout + "".join(open(os.path.join(log_dir, f), errors="replace").read()
                                  for f in sorted(os.listdir(log_dir)))
        crashed = any(s in logs for s in CRASH_SIGNS)
        crashes += crashed
        failed = p.returncode or sum(f"rank {r} done" in logs for r in range(args.workers)) < args.workers
        print(f"launch {k + 1}/{args.launches}: rc {p.returncode} {time.time() - started:.0f}s "
              f"{'CRASH' if crashed else 'FAILED' if failed else 'ok'}", flush=True)
        if crashed or failed:
            keep = os.path.join(args.keep, f"exit_crash_{os.getpid()}_{k + 1}.log")
            with open(keep, "w") as f:
                f.write(logs)
            print(f"  log kept: {keep}", flush=True)
        shutil.rmtree(log_dir, ignore_errors=True)
    print(f"crashes: {crashes}/{args.launches} launches; recipe {args.recipe} without {args.without}, "
          f"workers {args.workers}, "
          f"pin {args.pin}, MALLOC_PERTURB_ {args.perturb}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--launches", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pin", action="store_true", help="pin each worker and its threads to one core")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--recipe", choices=("ops", "comm"), default="ops",
                   help="ops: a few CPU ops; comm: groups, collectives, shared memory, pyfunc ops, traced grads")
    p.add_argument("--perturb", default="165", help="MALLOC_PERTURB_ (0: glibc's checks off)")
    p.add_argument("--without", type=_parts, default=[],
                   help=f"comm recipe: leave out some of {','.join(PARTS)}")
    p.add_argument("--keep", default=tempfile.gettempdir())
    args = p.parse_args()
    if args.as_worker:
        (comm_worker if args.recipe == "comm" else worker)(args)
        return 0
    return launches(args)


if __name__ == "__main__":
    sys.exit(main())
