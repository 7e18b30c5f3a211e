"""Rendezvous ports: picked outside the kernel's ephemeral range, and a port taken between picking
and binding it makes the test harness retry with a new one instead of failing the test (tests run
two files at a time, and gloo's connections take ephemeral ports all the time)."""
import socket

from mindspeed import net
from tests_extend.distributed import harness


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    low, _ = net._ephemeral_range()
    for _ in range(20):
        port = net.free_port()
        assert port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def _world(rank, world_size):
    import torch
    import torch.distributed as dist
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def test_harness_retries_a_taken_port(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = [taken.getsockname()[1]]
    monkeypatch.setattr(harness, "free_port", lambda: picks.pop(0) if picks else net.free_port())
    try:
        assert harness.run_distributed(_world, world_size=2, timeout=60) == [3.0, 3.0]
    finally:
        taken.close()
    assert picks == []      # the taken port was tried first


def _rank1_dies_of_a_signal(rank, world_size):
    import faulthandler
    import time
    if rank == 1:
        faulthandler._sigsegv()
    time.sleep(600)       # rank 0 waits on: only the harness noticing rank 1's death ends the test


def test_a_rank_that_dies_of_a_signal_fails_at_once_with_its_signal():
    import time

    import pytest
    start = time.monotonic()
    with pytest.raises(harness.DistributedTestError, match=r"rank 1 ---\nthe process ended without a result "
                                                            r"\(exit code -11: signal 11\)"):
        harness.run_distributed(_rank1_dies_of_a_signal, world_size=2, timeout=300)
    assert time.monotonic() - start < 200       # not the timeout
