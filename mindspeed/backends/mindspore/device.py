"""Device and RNG for the mindspore backend.

MindSpore has two random sources: the default Generator (mint ops) and the global seed plus
per-op counters that the classic ops (ops.rand, ops.dropout) draw from. A saved RNG state holds
both, so restoring it replays the same random numbers from either kind of op.
"""
from __future__ import annotations

import copy
import importlib
import os

import mindspore as ms

from mindspeed.backends.base import DeviceAPI
from mindspeed.backends.mindspore.device_select import mindspore_target

# the module, not the `seed` function mindspore.common re-exports under the same name
ms_seed = importlib.import_module("mindspore.common.seed")


class MsDevice(DeviceAPI):
    def __init__(self, name: str):
        self.name = name
        target = mindspore_target(name)
        try:
            ms.set_device(target)
        except RuntimeError:   # fixed once per process: a second backend object on the same device is fine
            if ms.get_context("device_target") != target:
                raise
        if name == "cpu":
            _size_cpu_kernel_pool()
            _run_ops_synchronously()

    def synchronize(self) -> None:
        ms.runtime.synchronize()

    def manual_seed(self, seed: int) -> None:
        ms.set_seed(seed)
        ms.manual_seed(seed)

    def get_rng_state(self):
        return {"generator": ms.get_rng_state(), "global_seed": ms_seed.get_seed(),
                "op_seeds": copy.deepcopy(ms_seed._KERNEL_SEED)}  # pylint: disable=protected-access

    def set_rng_state(self, state) -> None:
        if state["global_seed"] is not None:
            ms_seed._GLOBAL_SEED = state["global_seed"]        # pylint: disable=protected-access
        ms_seed._KERNEL_SEED.clear()                            # pylint: disable=protected-access
        ms_seed._KERNEL_SEED.update(copy.deepcopy(state["op_seeds"]))  # pylint: disable=protected-access
        if self.name != "cpu":    # the CPU generator's set_state kernel is not registered in 2.10
            ms.set_rng_state(state["generator"])


def kernel_pool_size(omp_num_threads: str) -> int | None:
    """MindSpore's CPU kernel pool for OMP_NUM_THREADS compute threads, or None (MindSpore's default).
    With synchronous ops the thread that launches a kernel computes a share of it beside the pool's
    threads, so N compute threads are a pool of N - 1 (at least 1: MindSpore has no empty pool)."""
    if not omp_num_threads.isdigit() or int(omp_num_threads) < 1:
        return None
    return max(1, int(omp_num_threads) - 1)


def _size_cpu_kernel_pool() -> None:
    """OMP_NUM_THREADS (the launch scripts set 1: one compute thread per process) also sizes
    MindSpore's CPU kernel thread pool, which does not read it: otherwise every msrun worker runs a
    pool of its own default size on the same cores."""
    size = kernel_pool_size(os.environ.get("OMP_NUM_THREADS", ""))
    if size is None:
        return
    from mindspore.device_context.cpu import op_tuning
    try:
        op_tuning.threads_num(size)
    except RuntimeError:      # set once per process: a second backend object keeps the first setting
        pass


def _run_ops_synchronously() -> None:
    """PyNative on CPU: each op runs before the call returns. In MindSpore's default asynchronous
    mode the Python thread busy-waits for the runtime thread at every read of a tensor's dtype,
    shape or value, taking a core from the kernels it waits for where a job's processes fill the
    cores (figures: docs/performance.md). MindSpore 2.10 names `mindspore.runtime.launch_blocking()`
    as its successor; that one blocks differently and was slower here."""
    ms.set_context(pynative_synchronize=True)


def pin_to_cores(local_index: int, local_count: int) -> None:
    """With MINDSPEED_MS_CPU_AFFINITY=1: give this process (the local_index-th of local_count on this
    host) its own share of the cores it may run on, every thread included; steadier steps on the
    2-process CPU example. Off by default: with it, MindSpore 2.10's own exit handler crashed 2-3 in
    10 two-process launches ("std::system_error: Invalid argument"), none in 22 without it
    (docs/native-crash.md). With more processes than cores nothing is pinned."""
    if os.environ.get("MINDSPEED_MS_CPU_AFFINITY", "0") != "1" or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // local_count if local_count else 0
    if share < 1:
        return
    mine = set(cores[local_index * share:(local_index + 1) * share])
    for tid in os.listdir("/proc/self/task"):     # threads MindSpore already started, and this one
        try:
            os.sched_setaffinity(int(tid), mine)
        except OSError:       # a thread that ended meanwhile
            pass
