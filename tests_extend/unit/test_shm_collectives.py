"""The shared-memory transport of the MindSpore backend's CPU collectives (shm_collectives.ShmGroup)
in real processes, without MindSpore: sums, gathers and broadcasts against numpy over many rounds
(a 64-byte slot, so both slot sets are reused many times), the same bits on every rank, and an error
(not another rank's data) when ranks call different collectives, one never arrives, or one dies."""
import multiprocessing as mp
import os
import time
import uuid

import numpy as np
import pytest

from mindspeed.backends.mindspore import shm_collectives
from mindspeed.backends.mindspore.shm_collectives import ShmGroup
from mindspeed.errors import CollectiveTimeout

N = 3


def data(rank, dtype, size=1001):
    rng = np.random.default_rng(rank)
    return (rng.standard_normal(size) * 10).astype(dtype)


def _rank(path, me, script, results):
    try:
        group = None
        while group is None:            # rank 0 creates the segment; the others wait for it
            try:
                group = ShmGroup(path, N, me, create=(me == 0), slot_bytes=64)
            except FileNotFoundError:
                pass
        results.put((me, script(group, me)))
    except Exception as e:              # noqa: BLE001 - the test inspects it
        results.put((me, e))


def _collectives(group, me):
    out = {}
    for dtype in (np.float32, np.float16, np.int64):
        out[f"sum {dtype.__name__}"] = group.all_reduce_sum(data(me, dtype).reshape(7, 11, 13))
    out["gather"] = group.all_gather(data(me, np.float32, 40).reshape(5, 8))
    out["broadcast"] = group.broadcast(data(me, np.float64, 9), src=2)
    out["empty"] = group.all_reduce_sum(np.zeros((0, 4), np.float32))
    return out


def _mismatched(group, me):
    if me == 0:
        return group.all_gather(np.ones(4, np.float32))
    return group.all_reduce_sum(np.ones(4, np.float32))


def _one_rank_stays_away(group, me):
    group.set_timeout(2 / 60)
    if me == 1:
        time.sleep(4)                     # alive (hung) past the others' timeout
        return "stayed away"
    return group.all_reduce_sum(np.ones(4, np.float32))


def _one_rank_dies(group, me):
    group.set_timeout(1)                  # a minute: the others must not wait it out
    if me == 1:
        os._exit(3)
    start = time.perf_counter()
    try:
        group.all_reduce_sum(np.ones(4, np.float32))
    except CollectiveTimeout as err:
        return str(err), time.perf_counter() - start


def run(script):
    path = f"/dev/shm/mindspeed-test-{uuid.uuid4().hex}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(path, me, script, results)) for me in range(N)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=60) for p in procs if script is not _one_rank_dies or p is not procs[1])
    for p in procs:
        p.join(timeout=30)
    if os.path.exists(path):
        os.unlink(path)
    return got


def test_sum_gather_broadcast_match_numpy_with_the_same_bits_on_every_rank():
    got = run(_collectives)
    for me in range(N):
        assert not isinstance(got[me], Exception), got[me]
    for dtype in (np.float32, np.float16, np.int64):
        every = [data(r, dtype).reshape(7, 11, 13) for r in range(N)]
        want = (every[0] + every[1]) + every[2]               # group-rank order
        for me in range(N):
            result = got[me][f"sum {dtype.__name__}"]
            assert result.dtype == dtype and result.shape == (7, 11, 13)
            np.testing.assert_array_equal(result, want)
            assert result.tobytes() == got[0][f"sum {dtype.__name__}"].tobytes()
    gathered = np.stack([data(r, np.float32, 40).reshape(5, 8) for r in range(N)])
    for me in range(N):
        np.testing.assert_array_equal(got[me]["gather"], gathered)
        np.testing.assert_array_equal(got[me]["broadcast"], data(2, np.float64, 9))
        assert got[me]["empty"].shape == (0, 4)


def test_different_collectives_on_two_ranks_fail_loudly():
    got = run(_mismatched)
    for me in range(N):
        assert isinstance(got[me], RuntimeError) and "different collective" in str(got[me]), got[me]


def test_a_rank_that_never_arrives_times_out_with_who_is_missing():
    got = run(_one_rank_stays_away)
    assert got[1] == "stayed away"
    for me in (0, 2):
        assert isinstance(got[me], CollectiveTimeout) and str(got[me]) == (
            f"rank {me}: shared-memory all_reduce_sum over ranks [0, 1, 2] timed out after 2 s "
            "(--distributed-timeout-minutes 0.0333333): rank 1 never joined it (hung, stopped, died or called fewer collectives); "
            "stopping"), got[me]


def test_a_rank_that_dies_stops_the_others_within_seconds_naming_it():
    got = run(_one_rank_dies)
    for me in (0, 2):
        line, waited = got[me]
        assert line.startswith(f"rank {me}: rank 1 (process ") and line.endswith(
            ") died while this rank waited for it in a shared-memory all_reduce_sum over ranks [0, 1, 2]; stopping"), line
        assert waited < 10, waited


def test_the_timeout_comes_from_the_flag_unless_the_environment_overrides_it(monkeypatch):
    monkeypatch.delenv(shm_collectives.TIMEOUT_ENV, raising=False)
    assert shm_collectives.timeout_from(0.5) == (30.0, "--distributed-timeout-minutes 0.5")
    assert shm_collectives.timeout_from(None) == (shm_collectives.SETUP_TIMEOUT_S, "while the groups are set up")
    monkeypatch.setenv(shm_collectives.TIMEOUT_ENV, "7")
    assert shm_collectives.timeout_from(0.5) == (7.0, "MINDSPEED_MS_SHM_TIMEOUT")
