"""The gloo test harness itself: what a rank returns reaches the caller whatever the timing."""
import pickle

import torch

from tests_extend.distributed.harness import _context, by_value, run_distributed


def _report_a_tensor_and_exit(queue):
    queue.put(by_value({"logits": torch.arange(6.0).reshape(2, 3)}))


def test_a_tensor_from_a_rank_that_has_already_exited_arrives():
    # the CI failure of 2026-11-28: a rank's tensors travelled as handles to its shared memory and
    # were gone when the caller read the queue after the rank had exited
    ctx = _context()
    queue = ctx.Queue()
    rank = ctx.Process(target=_report_a_tensor_and_exit, args=(queue,))
    rank.start()
    rank.join(timeout=60)
    assert rank.exitcode == 0
    result = pickle.loads(queue.get(timeout=10))
    assert torch.equal(result["logits"], torch.arange(6.0).reshape(2, 3))


def _rank_tensor(rank, world_size):
    return torch.full((3,), float(rank))


def test_each_rank_s_tensor_comes_back_in_rank_order():
    results = run_distributed(_rank_tensor, world_size=2, timeout=120)
    assert [r.tolist() for r in results] == [[0.0] * 3, [1.0] * 3]
