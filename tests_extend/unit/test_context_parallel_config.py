"""Context-parallel configuration: bad input is refused before any work, with a clear message;
the sharding and ring schedule are what the algorithms assume."""
import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan
from mindspeed.features.context_parallel.ring import ring_schedule
from mindspeed.features.context_parallel.sharding import local_positions
from mindspeed.features.context_parallel.ulysses import kv_repeats


def _plan(*argv, **extra):
    from mindspeed.flags.mindspeed_flags import parse_mindspeed_args
    args = parse_mindspeed_args(list(argv))
    for k, v in extra.items():
        setattr(args, k, v)
    return plan(args)


@pytest.mark.parametrize("argv, extra, message", [
    (["--context-parallel-size", "4", "--context-parallel-algo", "ulysses_cp_algo"],
     dict(num_attention_heads=6), "6 attention heads"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "ulysses_cp_algo"],
     dict(num_attention_heads=8, num_query_groups=3), "not a multiple of 3 key/value heads"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "megatron_cp_algo"],
     dict(world_size=6), "does not divide the world size 6"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "megatron_cp_algo"],
     dict(seq_length=20), "use a multiple of 8"),
    (["--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo"],
     dict(seq_length=9), "does not divide by --context-parallel-size 2"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "3"],
     {}, "--ulysses-degree-in-cp 3 must be >= 1 and divide --context-parallel-size 4"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo"],
     {}, "--ulysses-degree-in-cp None"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "megatron_cp_algo", "--cp-window-size", "3"],
     {}, "--cp-window-size 3 must be >= 1 and divide the ring size 4"),
    (["--context-parallel-size", "2", "--use-cp-send-recv-overlap"], {}, "applies to ring attention"),
    (["--context-parallel-size", "2", "--context-parallel-algo", "kvallgather_cp_algo", "--use-cp-send-recv-overlap"],
     {}, "not kvallgather_cp_algo"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "kvallgather_cp_algo"],
     dict(seq_length=20), "use a multiple of 8"),
])
def test_bad_cp_configuration_is_refused_with_a_clear_message(argv, extra, message):
    with pytest.raises(MindSpeedConfigError, match="MindSpeed: .*" + __import__("re").escape(message)):
        _plan(*argv, **extra)


def test_good_cp_configurations_plan_one_feature_each():
    for algo, extra in [("ulysses_cp_algo", []), ("megatron_cp_algo", ["--use-cp-send-recv-overlap"]),
                        ("hybrid_cp_algo", ["--ulysses-degree-in-cp", "2"]), ("kvallgather_cp_algo", [])]:
        p = _plan("--context-parallel-size", "4", "--context-parallel-algo", algo, *extra,
                  num_attention_heads=8, seq_length=64, world_size=8)
        assert [f.id for f in p.features] == [algo.replace("_", "-")]
    assert _plan("--context-parallel-size", "1").features == []


def test_kv_heads_are_repeated_until_they_divide_the_ulysses_degree():
    assert kv_repeats(8, 8, 4) == 1
    assert kv_repeats(8, 2, 4) == 2
    assert kv_repeats(8, 1, 4) == 4
    with pytest.raises(ValueError, match="do not divide by the Ulysses degree 4"):
        kv_repeats(6, 2, 4)


@pytest.mark.parametrize("algo, size, u", [("ulysses_cp_algo", 4, None), ("megatron_cp_algo", 4, None),
                                          ("hybrid_cp_algo", 4, 2), ("hybrid_cp_algo", 8, 2),
                                          ("kvallgather_cp_algo", 4, None)])
def test_shards_partition_the_sequence(algo, size, u):
    shards = [local_positions(32, algo, size, r, u) for r in range(size)]
    assert sorted(p for s in shards for p in s) == list(range(32))
    assert len({len(s) for s in shards}) == 1


def test_ring_sharding_is_load_balanced():
    # 2N chunks of 2: rank r holds chunks r and 2N-1-r
    assert local_positions(16, "megatron_cp_algo", 4, 1, None) == [2, 3, 12, 13]
    # the KV all-gather keeps Megatron's layout (its causal offsets assume it)
    assert local_positions(16, "kvallgather_cp_algo", 4, 1, None) == [2, 3, 12, 13]
    # hybrid u=2 on 4 ranks: ring of 2 over 4 chunks of 4; each Ulysses pair splits its two chunks
    assert [local_positions(16, "hybrid_cp_algo", 4, r, 2) for r in range(4)] == [
        [0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("size, window", [(4, 1), (4, 2), (8, 2), (8, 4)])
def test_ring_schedule_visits_every_block_once_and_rotations_pair_up(size, window):
    schedules = [ring_schedule(r, size, window) for r in range(size)]
    for r, steps in enumerate(schedules):
        assert sorted(owner for owner, _ in steps) == list(range(size))
        assert steps[0][0] == r and steps[-1][1] is None
    for step in range(size - 1):
        for r in range(size):
            dst, src = schedules[r][step][1]
            assert schedules[dst][step][1][1] == r and schedules[src][step][1][0] == r
    if window > 1:   # the first window-1 hops stay inside the window
        assert all(schedules[r][0][1][0] // window == r // window for r in range(size))
