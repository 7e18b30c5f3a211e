"""MainThreadCollection: while MindSpore runs a pyfunc kernel on one of its runtime threads, no
garbage collection starts there (it would free autograd graphs under the main thread's feet:
docs/native-crash.md); the main thread still collects the garbage at its gc points. The tests run
MindSpore's default asynchronous dispatch, where that hazard exists."""
import gc
import threading
import weakref

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import ops  # noqa: E402

from mindspeed.backends.mindspore.main_thread_gc import MainThreadCollection  # noqa: E402


@pytest.fixture(autouse=True)
def asynchronous_dispatch():
    """MindSpore's default dispatch, where pyfuncs run on its runtime threads (the backend makes CPU
    ops synchronous, and then they run on the calling thread)."""
    before = ms.get_context("pynative_synchronize")
    ms.set_context(pynative_synchronize=False)
    yield
    ms.set_context(pynative_synchronize=before)


class _Cycle:
    def __init__(self):
        self.me = self


def _steps(gc_point=lambda: None, steps: int = 10) -> tuple[int, int, list]:
    """PyNative forward+backward steps through a pyfunc that leaves cyclic garbage, with a low
    collection threshold -> (collections started off the main thread, pyfunc calls off it, weak
    references to the garbage)."""
    main = threading.main_thread()
    seen = {"gc": 0, "calls": 0}
    garbage = []

    def watch(phase, _info):
        if phase == "start" and threading.get_ident() != main.ident:
            seen["gc"] += 1

    def kernel(x):
        if threading.get_ident() != main.ident:
            seen["calls"] += 1
        for _ in range(50):
            garbage.append(weakref.ref(_Cycle()))
        return x * 2

    def bprop(x, out, dout):
        return (dout * 2,)

    op = ops.Custom(kernel, lambda s: s, lambda t: t, func_type="pyfunc", bprop=bprop)
    w = ms.Parameter(ms.Tensor(np.ones((4, 4), np.float32)), name="w")
    grad = ms.value_and_grad(lambda x: op(ops.matmul(x, w)).sum(), None, weights=[w])
    threshold = gc.get_threshold()
    gc.callbacks.append(watch)
    gc.set_threshold(10)
    try:
        for _ in range(steps):
            loss, _g = grad(ms.Tensor(np.ones((2, 4), np.float32)))
            assert float(loss.asnumpy()) == 64.0
            gc_point()
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(watch)
    return seen["gc"], seen["calls"], garbage


def test_no_collection_starts_off_the_main_thread_and_the_gc_points_collect():
    assert gc.isenabled()
    with MainThreadCollection() as gc_point:
        collections, calls, garbage = _steps(gc_point)
        assert calls > 0, "MindSpore ran every pyfunc on the main thread: this test checks nothing"
        assert collections == 0
        assert sum(ref() is None for ref in garbage) > len(garbage) // 2     # the gc points collected
    assert gc.isenabled()
    assert all(ref() is None for ref in garbage)       # and the end of the block collects the rest


def test_without_it_collections_do_start_on_runtime_threads():
    """The hazard it removes is real: the same steps, automatic collection on, collect off the main thread."""
    collections, calls, _garbage = _steps()
    assert calls > 0 and collections > 0


def test_what_exists_before_is_left_out_of_the_collections_for_the_block():
    frozen_before = gc.get_freeze_count()
    with MainThreadCollection():
        assert gc.get_freeze_count() > frozen_before
    assert gc.get_freeze_count() == frozen_before


def test_a_collector_turned_off_before_stays_off():
    gc.disable()
    try:
        with MainThreadCollection() as gc_point:
            gc_point()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_ops_without_collection_keeps_collections_off_runtime_threads_and_collects_after():
    """What a Trainer's steps run in when called outside a MainThreadCollection block."""
    from mindspeed.backends.mindspore.main_thread_gc import ops_without_collection
    with ops_without_collection():
        collections, calls, garbage = _steps(steps=3)
    assert calls > 0 and collections == 0
    assert gc.isenabled()
    assert all(ref() is None for ref in garbage)       # the young generation, collected at the end


def test_a_trainers_steps_called_directly_run_without_automatic_collection():
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    from tests_extend.distributed import mindspore_parity as mp
    backend = MindSporeBackend("cpu")
    args = parse_args(mp.trainer_argv(1), world_size=1)
    trainer = Trainer(args, backend, build_parallel_state(backend.comm, 1), GPTConfig.from_args(args, mp.VOCAB))
    seen = []
    real_step, real_loss = trainer._train_step, trainer._eval_loss
    trainer._train_step = lambda *a: (seen.append(gc.isenabled()), real_step(*a))[1]
    trainer._eval_loss = lambda *a: (seen.append(gc.isenabled()), real_loss(*a))[1]
    tokens, labels, mask = mp.batch(0)
    micro = {"tokens": tokens, "labels": labels, "loss_mask": mask}
    trainer.train_step([micro], 1)
    trainer.evaluate([micro])
    assert seen == [False, False] and gc.isenabled()


def test_with_the_backends_synchronous_cpu_ops_pyfuncs_run_on_the_calling_thread():
    """Where the hazard does not arise at all: the backend runs CPU ops synchronously."""
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    MindSporeBackend("cpu")
    collections, calls, _garbage = _steps(steps=3)
    assert calls == 0 and collections == 0
