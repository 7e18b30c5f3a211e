"""TorchInductor's vector-ISA choice in a fresh process: torch's own probe against MindSpeed's record
of it (mindspeed/vec_isa_memo.py), alternating over the rounds in fresh processes so both see the
same load. Prints the median time of `pick_vec_isa()` (what a process's first C++ kernel waits for),
their ratio, and the load average before and after.

    python tests_extend/benchmarks/bench_vec_isa_memo.py [--rounds 5]

Uses the machine's own kernel cache (the probe's programs already built there, as on any machine
that compiled once); one unmeasured "record" process first writes the record if it is missing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAYS = ("probe", "record")


def child(way: str) -> None:
    sys.path.insert(0, ROOT)
    from mindspeed import vec_isa_memo
    from mindspeed.patching import GLOBAL_PATCHES
    if way == "record":
        vec_isa_memo.install(GLOBAL_PATCHES)
    from torch._inductor import config, cpu_vec_isa
    start = time.perf_counter()
    picked = cpu_vec_isa.pick_vec_isa()
    seconds = time.perf_counter() - start
    print(json.dumps([seconds, str(picked), config.cpp.vec_isa_ok]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.child:
        child(opts.child)
        return 0
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    subprocess.run([sys.executable, __file__, "--child", "record"], env=env, capture_output=True, check=True)
    times = {way: [] for way in WAYS}
    picked = {}
    for _ in range(opts.rounds):
        for way in WAYS:
            out = subprocess.run([sys.executable, __file__, "--child", way], env=env, capture_output=True,
                                 text=True, check=True).stdout
            seconds, picked[way], switch = json.loads(out.strip().splitlines()[-1])
            times[way].append(seconds)
    for way in WAYS:
        print(f"{way:>6}: pick_vec_isa {statistics.median(times[way]) * 1000:.0f} ms -> {picked[way]}"
              + (" (vec_isa_ok from the record)" if way == "record" and switch else ""))
    ratio = statistics.median(times["probe"]) / statistics.median(times["record"])
    print(f"torch's probe / MindSpeed's record: {ratio:.2f}x ({opts.rounds} rounds); same ISA: "
          f"{picked['probe'] == picked['record']}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
