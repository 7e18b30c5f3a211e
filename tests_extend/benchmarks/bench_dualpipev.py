"""DualPipeV's bubbles against Megatron-Core's 1F1B and interleaved 1F1B (2 virtual stages), from the
schedules' own programs (mindspeed/features/parallel/schedule_sim.py), not from wall time: each rank
runs its program on a clock where a transfer takes no time and a Recv waits for its Send.

Costs, in units of one 1F1B stage's forward (that stage holds L/PP layers): forward 1, backward 2
(input gradient 1, weight gradient 1). A chunk of the interleaved schedule or of the V holds half the
layers: half of each. Printed per schedule and size: the idle units per rank per step (the step's
length minus the rank's work), their mean, and the ratio to 1F1B's; the load average is printed too
(the figures do not depend on it: they are counted, not timed).

"DualPipeV --moe-fb-overlap" runs each rank's program as the torch trainer runs it under the MoE overlap
(schedule_sim.fb_overlapped: a forward met by another micro-batch's backward is one combined step, the
weight gradients inside each backward); the last column counts those combined steps per rank: the slots
where one micro-batch's dispatch/combine all-to-alls can hide under the other's compute (the clock gives
the all-to-alls no time, so the idle units are the compute schedule's).

    python tests_extend/benchmarks/bench_dualpipev.py [--sizes 2x4 2x8 4x8 4x16 8x16]
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from mindspeed.features.parallel.schedule_sim import (Pair, dualpipev_programs, fb_overlapped,  # noqa: E402
                                                      interleaved_layout, interleaved_order, run_programs,
                                                      v_layout, with_transfers)

WORK = {"F": 1.0, "B": 2.0, "Bi": 1.0, "W": 1.0}     # one stage's layers


def megatron(pp: int, n: int, chunks: int):
    layout = interleaved_layout(pp, chunks)
    programs = [with_transfers(layout, r, interleaved_order(pp, n, r, chunks)) for r in range(pp)]
    return run_programs(layout, programs, lambda w: WORK[w.kind] / chunks)


def dualpipev(pp: int, n: int, dw_detach: bool):
    return run_programs(v_layout(pp), dualpipev_programs(pp, n, dw_detach), lambda w: WORK[w.kind] / 2)


def dualpipev_fb_overlap(pp: int, n: int):
    programs = [fb_overlapped(p) for p in dualpipev_programs(pp, n)]
    pairs = [sum(isinstance(item, Pair) for item in p) for p in programs]
    return run_programs(v_layout(pp), programs, lambda w: WORK[w.kind] / 2), pairs


def rows(pp: int, n: int):
    base = megatron(pp, n, 1)
    yield "1F1B", base, base
    yield "interleaved 1F1B (2 chunks)", megatron(pp, n, 2), base
    yield "DualPipeV", dualpipev(pp, n, False), base
    yield "DualPipeV --dualpipev-dw-detach", dualpipev(pp, n, True), base
    record, pairs = dualpipev_fb_overlap(pp, n)
    yield "DualPipeV --moe-fb-overlap", record, base, pairs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["2x4", "2x8", "4x8", "4x16", "8x16"],
                        help="PPxMICROBATCHES (micro-batches a multiple of PP: the interleaved schedule's rule)")
    a = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f} (counted, not timed); unit: one 1F1B stage's forward")
    print(f"{'PP x N':>7} | {'schedule':<31} | {'step':>6} | {'idle per rank':<40} | {'mean':>5} | vs 1F1B "
          f"| F+B steps per rank")
    for size in a.sizes:
        pp, n = map(int, size.split("x"))
        for name, record, base, *pairs in rows(pp, n):
            mean, base_mean = sum(record.idle) / pp, sum(base.idle) / pp
            idle = " ".join(f"{x:g}" for x in record.idle)
            paired = " ".join(map(str, pairs[0])) if pairs else ""
            print(f"{size:>7} | {name:<31} | {record.makespan:6g} | {idle:<40} | {mean:5g} | "
                  f"{mean / base_mean:7.2f} | {paired}")


if __name__ == "__main__":
    main()
