"""Where a test file's CPU goes: `python -m pytest -p tests_extend.cpu_accounting -p no:xdist <files>`.

Per test file: the CPU-seconds of the pytest process and of every process it reaped (getrusage
RUSAGE_SELF + RUSAGE_CHILDREN deltas: robust under load, unlike wall time), and the processes the
file started, by what they ran (a thread lists the worker's descendants in /proc every 0.1 s; the
suite's processes live a second or more, so none is missed). The thread's own CPU is left out.
Not loaded by the suite; docs/performance.md has what it found. One file at a time, without xdist:
a worker's children are its tests' children only when it runs one test at a time."""
import collections
import os
import resource
import threading
import time

import pytest

POLL_S = 0.1


def _stat(pid: str):
    """(ppid, start time in ticks) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _label(pid: int, parent_cmd: str) -> str:
    """What a process runs: its script or module (a forked rank shares its parent's command line)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if " ".join(argv) == parent_cmd:
        return "fork of the pytest worker"
    if len(argv) > 1 and os.path.basename(argv[0]).startswith("python"):
        rest = argv[1:]
        for flag in ("-m", "-c"):
            if flag in rest[:3]:
                i = rest.index(flag)
                return f"python {flag} {rest[i + 1].split(';')[0][:40] if i + 1 < len(rest) else ''}"
        scripts = [a for a in rest if not a.startswith("-")]
        return "python " + ("/".join(scripts[0].split("/")[-2:]) if scripts else "?")
    return os.path.basename(argv[0]) if argv else "?"


class _Descendants(threading.Thread):
    """Lists the processes started under this one while a test runs."""

    def __init__(self):
        super().__init__(daemon=True)
        self.root = os.getpid()
        with open("/proc/self/cmdline", "rb") as f:
            self.cmd = " ".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
        self.seen: dict[tuple[int, int], str] = {}
        self.stop = threading.Event()
        self.cpu = 0.0

    def run(self):
        while not self.stop.wait(POLL_S):
            self.scan()
        self.scan()
        self.cpu = time.thread_time()

    def scan(self):
        stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(p))}
        inside = {self.root}
        for pid in sorted(stats, key=lambda p: stats[p][1]):   # parents start before their children
            if stats[pid][0] in inside:
                inside.add(pid)
                key = (pid, stats[pid][1])
                if key not in self.seen:
                    self.seen[key] = _label(pid, self.cmd)


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class CpuAccounting:
    def __init__(self):
        self.files = collections.defaultdict(lambda: {"tests": 0, "cpu": 0.0, "procs": collections.Counter()})

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        watcher = _Descendants()
        watcher.start()
        before = _cpu()
        yield
        watcher.stop.set()
        watcher.join()
        entry = self.files[item.location[0]]
        entry["tests"] += 1
        entry["cpu"] += _cpu() - before - watcher.cpu
        entry["procs"].update(watcher.seen.values())

    def pytest_terminal_summary(self, terminalreporter):
        write = terminalreporter.write_line
        load = open("/proc/loadavg").read().split()[:3]
        write(f"CPU accounting (load average at the end {' '.join(load)}):")
        for path, entry in sorted(self.files.items(), key=lambda kv: -kv[1]["cpu"]):
            procs = entry["procs"]
            write(f"  {path}: {entry['tests']} tests, {entry['cpu']:.1f} CPU-s, {sum(procs.values())} processes")
            for label, n in procs.most_common():
                write(f"      {n:4d} {label}")


def pytest_configure(config):
    config.pluginmanager.register(CpuAccounting(), "mindspeed-cpu-accounting")
