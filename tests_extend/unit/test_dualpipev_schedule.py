"""DualPipeV's schedule function (pure Python): each rank's order of F/B/W against DeepSeek's
DualPipeV phases and upstream MindSpeed's phase counts, and the ranks' programs pairing up."""
from __future__ import annotations

import pytest

from mindspeed.features.parallel.dualpipev_schedule import Work, dualpipev_order, min_microbatches
from mindspeed.features.parallel.schedule_sim import (Pair, Recv, ScheduleError, Send, dualpipev_programs,
                                                      fb_overlapped, interleaved_layout, interleaved_order,
                                                      run_programs, v_layout, with_transfers)


def _text(order) -> str:
    return " ".join(f"{w.kind}{w.chunk}.{w.mb}" for w in order)


# DeepSeek's DualPipeV at 2 ranks, 4 micro-batches, written out by hand from its eight phases
# (F0 warm-up, F0F1, B1-W-F1, F0B1F1B0, B1F1B0, B1B0, W-B0, W); Bi: the weight gradient deferred to a W.
PP2_DETACHED = [
    "F0.0 F0.1 F0.2 F1.0 Bi1.0 W1.0 F1.1 F0.3 B1.1 F1.2 B0.0 B1.2 F1.3 B0.1 B1.3 Bi0.2 W0.2 Bi0.3 W0.3",
    "F0.0 F1.0 F0.1 F1.1 F0.2 B1.0 F1.2 B0.0 F0.3 B1.1 F1.3 B0.1 B1.2 B0.2 Bi1.3 Bi0.3 W1.3 W0.3",
]
# upstream's default keeps the cool-down's backwards whole (its phase 3 still defers)
PP2_WHOLE = [
    "F0.0 F0.1 F0.2 F1.0 Bi1.0 W1.0 F1.1 F0.3 B1.1 F1.2 B0.0 B1.2 F1.3 B0.1 B1.3 B0.2 B0.3",
    "F0.0 F1.0 F0.1 F1.1 F0.2 B1.0 F1.2 B0.0 F0.3 B1.1 F1.3 B0.1 B1.2 B0.2 B1.3 B0.3",
]


@pytest.mark.parametrize("detach, expected", [(True, PP2_DETACHED), (False, PP2_WHOLE)])
def test_two_ranks_run_deepseeks_order(detach, expected):
    assert [_text(dualpipev_order(2, 4, r, detach)) for r in range(2)] == expected


def _phase_counts(order) -> tuple:
    """Upstream MindSpeed's first three phases read back from an order: warm-up forwards, F0F1 pairs,
    B1-W-F1 triples."""
    tokens = [("W" if w.kind == "W" else w.kind[0]) + str(w.chunk) for w in order]
    warmup = pos = tokens.index("F1") - 1
    pairs = triples = 0
    while tokens[pos:pos + 2] == ["F0", "F1"]:
        pairs, pos = pairs + 1, pos + 2
    while tokens[pos:pos + 3] == ["B1", "W1", "F1"]:
        triples, pos = triples + 1, pos + 3
    return warmup, pairs, triples


def test_four_ranks_match_upstreams_phase_table():
    """PP 4, 10 micro-batches (upstream's figure): the phases of upstream's generate_dualpipev_schedule
    (warm-up 2PP-2-2r, r+1 F0F1 pairs, PP-r-1 B1-W-F1), evaluated by hand; every micro-batch through
    both chunks once forward and once backward, every deferred weight gradient computed once."""
    expected = [(6, 1, 3), (4, 2, 2), (2, 3, 1), (0, 4, 0)]
    for rank, (warmup, pairs, triples) in enumerate(expected):
        order = dualpipev_order(4, 10, rank, dw_detach=True)
        assert _phase_counts(order) == (warmup, pairs, triples)
        for chunk in (0, 1):
            assert [w.mb for w in order if w.kind == "F" and w.chunk == chunk] == list(range(10))
            assert sorted(w.mb for w in order if w.kind[0] == "B" and w.chunk == chunk) == list(range(10))
        deferred = [(w.chunk, w.mb) for w in order if w.kind == "Bi"]
        assert [(w.chunk, w.mb) for w in order if w.kind == "W"] == deferred     # first deferred, first computed


def test_the_cool_down_defers_only_with_dw_detach():
    for rank in range(4):
        whole = dualpipev_order(4, 10, rank, dw_detach=False)
        detached = dualpipev_order(4, 10, rank, dw_detach=True)
        assert sum(w.kind == "W" for w in whole) == 3 - rank           # phase 3's only
        assert sum(w.kind == "W" for w in detached) > sum(w.kind == "W" for w in whole)


@pytest.mark.parametrize("pp, n", [(2, 3), (2, 8), (3, 5), (4, 7), (4, 10), (8, 15)])
@pytest.mark.parametrize("detach", [False, True])
def test_programs_pair_up_and_finish(pp, n, detach):
    """Both sides of every transfer come from the layout: run together, every Recv finds its Send in
    order on its channel, every dependency is met first, no rank waits forever."""
    unit = {"F": 1, "B": 2, "Bi": 1, "W": 1}
    record = run_programs(v_layout(pp), dualpipev_programs(pp, n, detach), lambda w: unit[w.kind])
    assert all(b == 3 * 2 * n for b in record.busy)                   # two chunks, N micro-batches, F+B+W each
    assert record.makespan == record.busy[0] + record.idle[0]


# --moe-fb-overlap: each forward met by another micro-batch's backward runs with it, [F+B] (upstream's
# F0-B1 / F1-B0 slots); the combined step computes weight gradients in the backward (no Bi, no W)
PP2_FB = [
    "F0.0 F0.1 F0.2 F1.0 B1.0 F1.1 [F0.3+B1.1] [F1.2+B0.0] B1.2 [F1.3+B0.1] B1.3 B0.2 B0.3",
    "F0.0 F1.0 F0.1 F1.1 [F0.2+B1.0] [F1.2+B0.0] [F0.3+B1.1] [F1.3+B0.1] B1.2 B0.2 B1.3 B0.3",
]


def _pairs_text(program) -> str:
    return " ".join(f"[{_text(item)}]".replace(" ", "+") if isinstance(item, Pair) else _text([item])
                    for item in program if not isinstance(item, (Send, Recv)))


def test_fb_overlap_pairs_the_vs_forwards_with_other_microbatches_backwards():
    assert [_pairs_text(fb_overlapped(p)) for p in dualpipev_programs(2, 4)] == PP2_FB


@pytest.mark.parametrize("pp, n", [(2, 3), (2, 8), (3, 5), (4, 7), (4, 10), (8, 15)])
def test_fb_overlapped_programs_keep_the_order_pair_up_and_finish(pp, n):
    """The backward's Recvs move before its Pair, the forward's Sends after it: the programs still
    pair up and finish; each rank's F/B order is DualPipeV's; every rank past the first has Pairs."""
    programs = [fb_overlapped(p) for p in dualpipev_programs(pp, n)]
    record = run_programs(v_layout(pp), programs, lambda w: {"F": 1, "B": 2}[w.kind])
    assert all(b == 3 * 2 * n for b in record.busy)
    for rank, program in enumerate(programs):
        flat = [w for item in program if not isinstance(item, (Send, Recv))
                for w in (item if isinstance(item, Pair) else (item,))]
        assert flat == [w._replace(kind="B" if w.kind == "Bi" else w.kind) for w in dualpipev_order(pp, n, rank)
                        if w.kind != "W"]
        assert sum(isinstance(item, Pair) for item in program) >= n - 2 * pp + rank + 1


def test_a_pair_whose_backward_needs_its_forward_is_caught():
    layout = v_layout(2)
    programs = dualpipev_programs(2, 3)
    bad = [Pair(Work("F", 0, 0), Work("B", 0, 0))] + [i for i in programs[0] if i != Work("F", 0, 0)]
    with pytest.raises(ScheduleError):
        run_programs(layout, [bad, programs[1]], lambda w: 1)


def test_the_vs_turn_and_ends_stay_on_one_rank():
    programs = dualpipev_programs(4, 7)
    transfers = [item for program in programs for item in program if isinstance(item, (Send, Recv))]
    assert all(abs(t.peer - r) == 1 for r, program in enumerate(programs) for t in program
               if isinstance(t, (Send, Recv)))
    # stage 0 reads the data, the loss ends stage 7, and the turn (stage 3 -> 4) stays on rank 3
    assert {t.stage for t in transfers if t.what == "act"} == {1, 2, 3, 5, 6, 7}
    assert {t.stage for t in transfers if t.what == "grad"} == {0, 1, 2, 4, 5, 6}


def test_a_broken_order_is_caught():
    layout = v_layout(2)
    programs = dualpipev_programs(2, 4)
    swapped = [with_transfers(layout, 1, [Work("F", 0, 1), Work("F", 0, 0)] + dualpipev_order(2, 4, 1)[2:])]
    with pytest.raises(ScheduleError):
        run_programs(layout, [programs[0]] + swapped, lambda w: 1)
    early_w = [with_transfers(layout, 0, [Work("W", 0, 0)] + dualpipev_order(2, 4, 0))]
    with pytest.raises(ScheduleError):
        run_programs(layout, early_w + [programs[1]], lambda w: 1)


def test_too_few_microbatches_are_refused():
    assert min_microbatches(4) == 7
    dualpipev_order(4, 7, 0)
    with pytest.raises(ValueError, match="at least 7"):
        dualpipev_order(4, 6, 0)


def test_megatron_orders_give_the_known_bubbles():
    """The benchmark's baselines: 1F1B idles (PP-1)(F+B) per rank, interleaving over v chunks 1/v of it."""
    for chunks, bubble in ((1, 9.0), (2, 4.5)):
        layout = interleaved_layout(4, chunks)
        programs = [with_transfers(layout, r, interleaved_order(4, 8, r, chunks)) for r in range(4)]
        record = run_programs(layout, programs, lambda w: (1 if w.kind == "F" else 2) / chunks)
        assert record.idle == [bubble] * 4
