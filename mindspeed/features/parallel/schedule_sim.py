"""Pipeline schedules as data: each rank's transfers from its order of work, a check that the ranks'
programs pair up and finish, and their idle time on a unit-cost clock. Pure Python.

A layout maps pipeline stages (0 .. S-1, data flowing up) to (rank, chunk). An order is a list of
dualpipev_schedule.Work items. with_transfers adds a Recv right before the work that needs a
tensor from another rank and a Send right after the work that makes one. Activations and gradients
travel on two channels (a tag each): the programs of two ranks pair up when, on each channel, the
Sends from a to b come in the order b receives them (checked by run_programs), which is what gloo's
ordered point-to-point messages need. (On one channel they would not: between neighbours of the V
both chunk 0's activations and chunk 1's gradients go the same way, in different orders.)
"""
from __future__ import annotations

from collections import namedtuple

from mindspeed.features.parallel.dualpipev_schedule import Work, dualpipev_order, v_stage

Send = namedtuple("Send", "what peer stage mb")     # what: act (forward output) or grad (input gradient)
Pair = namedtuple("Pair", "forward backward")       # run together (--moe-fb-overlap): one's all-to-alls under the other's compute
Recv = namedtuple("Recv", "what peer stage mb")     # stage: the receiving stage
Layout = namedtuple("Layout", "pp stages place")    # place: stage -> (rank, chunk)
Record = namedtuple("Record", "makespan busy idle")  # per-rank busy and idle, in the clock's units


def v_layout(pp: int) -> Layout:
    place = {v_stage(pp, r, c): (r, c) for r in range(pp) for c in (0, 1)}
    return Layout(pp, 2 * pp, place)


def interleaved_layout(pp: int, chunks: int) -> Layout:
    """Megatron's: virtual stage v of rank r is stage v x PP + r (one chunk: plain 1F1B)."""
    return Layout(pp, pp * chunks, {v * pp + r: (r, v) for r in range(pp) for v in range(chunks)})


def with_transfers(layout: Layout, rank: int, order: list[Work]) -> list:
    """The order with the Sends and Recvs its work needs, both sides derived from the layout."""
    stage_of = {c: s for s, (r, c) in layout.place.items() if r == rank}
    program = []
    for work in order:
        stage = stage_of[work.chunk]
        if work.kind == "F":
            program += _transfer(layout, rank, Recv, "act", stage - 1, stage, work.mb)
            program.append(work)
            program += _transfer(layout, rank, Send, "act", stage + 1, stage + 1, work.mb)
        elif work.kind in ("B", "Bi"):
            program += _transfer(layout, rank, Recv, "grad", stage + 1, stage, work.mb)
            program.append(work)
            program += _transfer(layout, rank, Send, "grad", stage - 1, stage - 1, work.mb)
        else:
            program.append(work)
    return program


def _transfer(layout, rank, kind, what, peer_stage, to_stage, mb) -> list:
    if not 0 <= peer_stage < layout.stages or layout.place[peer_stage][0] == rank:
        return []       # the first or last stage, or the V's turn on one rank: no message
    return [kind(what, layout.place[peer_stage][0], to_stage, mb)]


def dualpipev_programs(pp: int, num_microbatches: int, dw_detach: bool = False) -> list[list]:
    layout = v_layout(pp)
    return [with_transfers(layout, r, dualpipev_order(pp, num_microbatches, r, dw_detach)) for r in range(pp)]


def fb_overlapped(program: list) -> list:
    """A rank's program for --moe-fb-overlap: each forward followed by the backward of another
    micro-batch becomes one Pair (Megatron-Core's combined forward-backward step). The Pair needs
    both inputs, so the backward's Recvs move before it and the forward's Sends after it (sends do
    not block; run_programs checks the programs still pair up). Weight gradients are not deferred:
    the combined step's backward computes them (a Bi is a whole B, its W goes)."""
    program = [_whole(item) for item in program if not (isinstance(item, Work) and item.kind == "W")]
    out, i = [], 0
    while i < len(program):
        item, j = program[i], i + 1
        while j < len(program) and not isinstance(program[j], Work):
            j += 1
        if _pairs(item, program[j] if j < len(program) else None):
            between, k = program[i + 1:j], j + 1
            while k < len(program) and isinstance(program[k], Send):
                k += 1
            out += [t for t in between if isinstance(t, Recv)] + [Pair(item, program[j])]
            out += [t for t in between if isinstance(t, Send)] + program[j + 1:k]
            i = k
        else:
            out.append(item)
            i += 1
    return out


def _whole(item):
    return item._replace(kind="B") if isinstance(item, Work) and item.kind == "Bi" else item


def _pairs(first, second) -> bool:
    """A forward then a backward of another micro-batch (that backward needs nothing the forward makes)."""
    return (isinstance(first, Work) and first.kind == "F" and isinstance(second, Work) and second.kind == "B"
            and first.mb != second.mb)


def one_f_one_b_order(pp: int, num_microbatches: int, rank: int) -> list[Work]:
    return interleaved_order(pp, num_microbatches, rank, chunks=1)


def interleaved_order(pp: int, num_microbatches: int, rank: int, chunks: int) -> list[Work]:
    """Megatron-Core's (interleaved) 1F1B: warm-up forwards, then one forward one backward, then the
    remaining backwards; micro-batches go through a rank's chunks in groups of PP."""
    if chunks > 1 and num_microbatches % pp:
        raise ValueError(f"the interleaved schedule needs micro-batches in multiples of PP {pp}")
    total = num_microbatches * chunks
    warmup = min(total, pp - rank - 1 if chunks == 1 else (pp - rank - 1) * 2 + (chunks - 1) * pp)

    def virtual(k: int, kind: str) -> Work:
        group, pos = divmod(k, pp * chunks)
        chunk = pos // pp
        return Work(kind, chunk if kind == "F" else chunks - 1 - chunk, group * pp + pos % pp)

    order = [virtual(k, "F") for k in range(warmup)]
    for k in range(total - warmup):
        order += [virtual(warmup + k, "F"), virtual(k, "B")]
    return order + [virtual(k, "B") for k in range(total - warmup, total)]


def run_programs(layout: Layout, programs: list[list], cost) -> Record:
    """Runs the programs on a clock (`cost(work)`: a work item's duration; transfers take no time; a
    Recv waits for its Send) and checks them: every dependency met, every message received in the
    order it was sent, no rank left waiting. Raises ScheduleError otherwise."""
    clocks, busy, pos = [0.0] * len(programs), [0.0] * len(programs), [0] * len(programs)
    sent, done = {}, {}       # (src, dst, what) -> [(message, time)]; (kind, stage, mb) -> finish time
    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(programs):
            while pos[rank] < len(program):
                item = program[pos[rank]]
                if isinstance(item, Recv):
                    queue = sent.get((item.peer, rank, item.what))
                    if not queue:
                        break           # its Send has not run yet
                    message, at = queue.pop(0)
                    if message != (item.what, item.stage, item.mb):
                        raise ScheduleError(f"rank {rank} receives {item} but rank {item.peer} sent {message}")
                    clocks[rank] = max(clocks[rank], at)
                elif isinstance(item, Send):
                    sent.setdefault((rank, item.peer, item.what), []).append(((item.what, item.stage, item.mb), clocks[rank]))
                else:
                    _run_work(layout, rank, item, cost, (clocks, busy, done))
                pos[rank] += 1
                progress = True
    stuck = [r for r, program in enumerate(programs) if pos[r] < len(program)]
    if stuck or any(sent.values()):
        raise ScheduleError(f"ranks {stuck} wait for messages never sent (deadlock), or messages are left unread")
    makespan = max(clocks)
    return Record(makespan, busy, [makespan - b for b in busy])


def _run_work(layout, rank, item, cost, state) -> None:
    """A work item, or a Pair (its two works back to back: the clock counts their compute, the
    all-to-alls hidden under it take none)."""
    clocks, busy, done = state
    works = tuple(item) if isinstance(item, Pair) else (item,)
    for work in works:
        _check_ready(layout, rank, work, done)
    for work in works:
        clocks[rank] += cost(work)
        busy[rank] += cost(work)
        done[_key(layout, rank, work)] = clocks[rank]


class ScheduleError(AssertionError):
    pass


def _key(layout, rank, work):
    stage = next(s for s, (r, c) in layout.place.items() if (r, c) == (rank, work.chunk))
    return ("F" if work.kind == "F" else "B" if work.kind != "W" else "W", stage, work.mb)


def _check_ready(layout, rank, work, done) -> None:
    """What the work needs was computed (on this rank, or on another and received)."""
    _, stage, mb = _key(layout, rank, work)
    needs = {"F": [("F", stage - 1, mb)] if stage else [],
             "B": [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage + 1 < layout.stages else []),
             "W": [("B", stage, mb)]}["B" if work.kind == "Bi" else work.kind]
    missing = [n for n in needs if n not in done]
    if missing:
        raise ScheduleError(f"rank {rank} runs {work} before {missing}")
