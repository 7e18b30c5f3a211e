"""What a test process pays to start, with and without triton importable:
`python tests_extend/benchmarks/bench_process_start.py [--repeats 8]`.

Each run is a fresh interpreter importing what every rank of the suite imports (MindSpeed's adaptor,
then Megatron-Core); "without" hides triton as an uninstalled package looks (sys.modules entry None:
find_spec answers None, import fails), which is what the `test` extra now gives the suite (triton moved
to the megatron-core-tests extra). The two kinds alternate so load drifts hit both; CPU-seconds of the
child (user + system, from wait4), not wall time, so the figure holds under load. Needs triton installed."""
import argparse
import os
import subprocess
import sys

IMPORTS = "import mindspeed.megatron_adaptor, megatron.core, megatron.core.transformer"
KINDS = {"triton importable": IMPORTS, "triton hidden": "import sys; sys.modules['triton'] = None; " + IMPORTS}


def _child_cpu(code: str) -> float:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, code
    return usage.ru_utime + usage.ru_stime


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=8)
    repeats = parser.parse_args().repeats
    load = os.getloadavg()
    times = {kind: [] for kind in KINDS}
    for _ in range(repeats):
        for kind, code in KINDS.items():
            times[kind].append(_child_cpu(code))
    means = {kind: sum(t) / len(t) for kind, t in times.items()}
    for kind, mean in means.items():
        print(f"{kind}: {mean:.3f} CPU-s per process (min {min(times[kind]):.3f}, {repeats} runs)")
    with_t, without = means["triton importable"], means["triton hidden"]
    print(f"triton costs {with_t - without:.3f} CPU-s per process; without/with {without / with_t:.3f}; "
          f"load average {load[0]:.1f} -> {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
