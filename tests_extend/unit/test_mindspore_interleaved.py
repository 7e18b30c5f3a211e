"""The MindSpore trainer's interleaved 1F1B (training/mindspore/interleaved.py) follows Megatron-Core's
own schedule: each stage's order of forwards and backwards is the one Megatron-Core's schedule table
and warmup counts give, and the exchange plan both stages follow runs every step of that order once,
each after what it needs has arrived. Training with it: tests_extend/distributed/test_mindspore_parity_pp.py."""
from types import SimpleNamespace

import pytest

pytest.importorskip("mindspore")

from mindspeed.training.mindspore.interleaved import exchange_plan, megatron_order  # noqa: E402


def megatron_core_order(rank: int, pp: int, chunks: int, n: int) -> list:
    """The steps of forward_backward_pipelining_with_interleaving (Megatron-Core 0.16) on stage `rank`:
    its schedule table, its warmup count, its backward chunk (reversed), and each chunk's backwards
    taking the oldest forward's micro-batch (its input_tensors[chunk].pop(0))."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table
    table = get_schedule_table(n, chunks, pp)
    # the stage's place in the pipeline: what Megatron-Core reads from its P2P communicator
    where = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: rank),
                            virtual_pipeline_model_parallel_size=chunks)
    total, _, warmup, remaining = get_pp_rank_microbatches(n, chunks, pp, p2p_communicator=where)
    pending = {c: [] for c in range(chunks)}

    def forward(k):
        mb, c = table[k]
        pending[c].append(mb)
        return ("F", c, mb)

    def backward(k):
        c = chunks - 1 - table[k][1]
        return ("B", c, pending[c].pop(0))

    steps = [forward(k) for k in range(warmup)]
    for k in range(remaining):
        steps += [forward(warmup + k), backward(k)]
    return steps + [backward(k) for k in range(remaining, total)]


@pytest.mark.parametrize("chunks, n", [(2, 2), (2, 4), (2, 6), (3, 4), (4, 8)])
def test_each_stage_runs_megatron_core_s_order(chunks, n):
    for rank in range(2):
        assert megatron_order(rank, 2, chunks, n) == megatron_core_order(rank, 2, chunks, n), (rank, chunks, n)


@pytest.mark.parametrize("chunks, n", [(2, 2), (2, 4), (3, 4), (4, 8)])
def test_the_exchange_plan_runs_each_order_once_after_its_inputs(chunks, n):
    ticks = exchange_plan(2, chunks, n)
    last = 2 * chunks - 1
    for rank in range(2):
        assert [t[rank][0] for t in ticks if t[rank][0] is not None] == megatron_order(rank, 2, chunks, n)
    sent_at = {}
    for when, tick in enumerate(ticks):
        for rank, (step, sent) in enumerate(tick):
            if sent is not None:
                assert sent[1] % 2 != rank           # every transfer crosses to the other stage
                sent_at[sent] = when
            if step is None:
                continue
            kind, chunk, mb = step
            v = 2 * chunk + rank
            need = ("in", v, mb) if kind == "F" and v > 0 else ("dout", v, mb) if kind == "B" and v < last else None
            assert need is None or sent_at.get(need, when) < when, (step, need)
    # every activation but the last virtual stage's and every gradient but the first's is sent once
    assert len(sent_at) == 2 * n * last
    # no more ticks than steps on a stage plus the pipeline's fill and drain
    assert len(ticks) <= 2 * n * chunks + 2
