"""All-reduce(sum), all-gather and broadcast through shared memory, for a MindSpore group whose
ranks all run on one x86-64 host with the CPU device.

Why: MindSpore 2.10's CPU collectives (MCCL) move 1 MB in 5.7-6.6 ms; a copy through /dev/shm
moves it in a fraction of a millisecond. The collective is a MindSpore primitive (a `pyfunc`
Custom op, CPU only), so it runs inside traced graphs and their backward as MCCL's would.

Protocol, per group: one /dev/shm segment holding an arrival counter per rank and two sets of one
slot per rank. A collective is a sequence of rounds (one per slot-sized chunk); in round c each rank
writes its chunk into its slot of set c % 2, publishes c as its counter, waits until every counter
reaches c and then reads all slots in rank order (so every rank computes the same sum). A set is
written again two rounds later, by which time every rank has published c + 1 and so finished
reading round c. x86-64 keeps stores in order, so a published counter means its slot is written;
other CPUs (aarch64) do not, and keep MCCL. Each rank also publishes what it is doing (collective,
dtype, size, chunk): ranks that call different collectives get an error, not each other's data.
Each rank also leaves its process's identity in its header line, so a rank kept waiting notices
within a second that the one it waits for has died (killed, crashed) instead of waiting out the
timeout, which is meant for ranks that hang.
"""
from __future__ import annotations

import mmap
import os
import platform
import sys
import threading
import time
import zlib

import numpy as np

from mindspeed.errors import CollectiveTimeout, report

SLOT_BYTES = 4 << 20          # a chunk per round; larger tensors take several rounds
_HEADER_STRIDE = 64           # bytes per rank counter: one cache line each
SPIN_S = 0.01                 # how long a waiting rank spins before it sleeps
LIVENESS_EVERY_S = 1.0        # how often a waiting rank looks whether the late ones still live
MIN_NAP_S, MAX_NAP_S = 50e-6, 1e-3   # its sleeps between looks: doubling from the first to the last
TIMEOUT_ENV = "MINDSPEED_MS_SHM_TIMEOUT"
# while the groups are set up (before the trainer reads --distributed-timeout-minutes): ranks start
# minutes apart on a loaded machine
SETUP_TIMEOUT_S = 1800.0


def timeout_from(minutes: float | None) -> tuple[float, str]:
    """(seconds a rank waits for the others, what set it, for the timeout's message):
    MINDSPEED_MS_SHM_TIMEOUT when set (an override), else --distributed-timeout-minutes, else the
    setup's."""
    if os.environ.get(TIMEOUT_ENV):
        return float(os.environ[TIMEOUT_ENV]), TIMEOUT_ENV
    if minutes is None:
        return SETUP_TIMEOUT_S, "while the groups are set up"
    return minutes * 60.0, f"--distributed-timeout-minutes {minutes:g}"


def shm_allowed() -> bool:
    """This process may use the shared-memory path: x86-64, /dev/shm writable, not turned off."""
    return (os.environ.get("MINDSPEED_MS_SHM_COLLECTIVES", "1") != "0" and platform.machine() in ("x86_64", "AMD64")
            and os.access("/dev/shm", os.W_OK))


def host_id() -> int:
    """A number that is equal for processes on one host (fits float32 exactly: 2^24)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            key = f.read().strip() + platform.node()
    except OSError:
        key = platform.node()
    return zlib.crc32(key.encode()) & 0xFFFFFF


class ShmGroup:
    """The shared-memory transport of one group, seen from group rank `me` of `n`."""

    def __init__(self, path: str, n: int, me: int, create: bool, slot_bytes: int = SLOT_BYTES, spin: bool = True,
                 ranks=None):
        self.n, self.me, self.path, self.slot_bytes = n, me, path, slot_bytes
        self.ranks = list(ranks) if ranks is not None else list(range(n))    # the job's ranks, for messages
        self._size = n * _HEADER_STRIDE + 2 * n * slot_bytes
        # the creator sizes it under a temporary name first: the others never see a short file
        fd = os.open(path + ".new" if create else path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, self._size)
                os.rename(path + ".new", path)
            self._map = mmap.mmap(fd, self._size)
        finally:
            os.close(fd)
        header = np.frombuffer(self._map, np.int64, n * _HEADER_STRIDE // 8).reshape(n, _HEADER_STRIDE // 8)
        # one cache line per rank: its round counter, then its signature for each slot set (a rank
        # may publish round c + 1 while another still checks round c)
        self._arrived = header[:, 0]
        self._signatures = header[:, 1:3].T
        self._identities = header[:, 3:6]
        self._identities[me] = process_identity()
        self._slots = np.frombuffer(self._map, np.uint8, offset=n * _HEADER_STRIDE).reshape(2, n, slot_bytes)
        self._round = 0
        self._lock = threading.Lock()         # MindSpore may call a pyfunc from more than one thread
        self.timeout_s, self.timeout_source = timeout_from(None)
        self.spin_s = SPIN_S if spin else 0.0

    def set_timeout(self, minutes: float) -> None:
        """--distributed-timeout-minutes' value as how long a rank waits (MINDSPEED_MS_SHM_TIMEOUT wins)."""
        self.timeout_s, self.timeout_source = timeout_from(minutes)

    def unlink(self) -> None:
        """Remove the name once every rank has mapped the segment (the mapping stays valid)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _exchange(self, what: str, chunk: np.ndarray, write: bool) -> np.ndarray:
        """One round: publish `chunk` (bytes) if `write`; return every rank's slot set [n, slot_bytes].
        `what` names the collective and chunk; every rank must be at the same one."""
        self._round += 1
        c = self._round
        slots, signatures = self._slots[c % 2], self._signatures[c % 2]
        if write:
            slots[self.me, :chunk.size] = chunk
        signatures[self.me] = zlib.crc32(what.encode())
        self._arrived[self.me] = c
        self._wait_for(c, what)
        if (signatures != signatures[self.me]).any():
            raise RuntimeError(f"shared-memory collective: group rank {self.me} is at {what} while another rank "
                               "called a different collective; every rank must call the same ones in the same order")
        return slots

    def _wait_for(self, c: int, what: str) -> None:
        """Spin while the wait is short (a rank that sleeps here wakes late and loses its core: measured,
        steps of 450 ms turned into 650 ms), then sleep between looks, longer the longer the wait (a
        pipeline stage waits out the other stage's whole forward). `spin` is off where the job's processes
        on this host outnumber its cores, and nobody spins while the host is busier than its cores
        (other jobs): a spinner would take the core of a process it waits for."""
        arrived = self._arrived
        if arrived.min() >= c:
            return
        start = time.perf_counter()
        spin_until = start + (self.spin_s if self.spin_s and _host_has_idle_cores(start) else 0.0)
        look_at = start + LIVENESS_EVERY_S
        nap = MIN_NAP_S
        while arrived.min() < c:
            now = time.perf_counter()
            if now < spin_until:
                continue
            time.sleep(nap)
            nap = min(2 * nap, MAX_NAP_S)
            if now > look_at:
                look_at = now + LIVENESS_EVERY_S
                self._stop_if_a_late_rank_died(c, what)
            if now - start > self.timeout_s:
                late = [self.ranks[r] for r in range(self.n) if arrived[r] < c]
                who = f"rank {late[0]}" if len(late) == 1 else f"ranks {late}"
                raise CollectiveTimeout(
                    f"rank {self.ranks[self.me]}: shared-memory {what.split()[0]} over ranks {self.ranks} timed "
                    f"out after {self.timeout_s:g} s ({self.timeout_source}): {who} never joined it (hung, "
                    "stopped, died or called fewer collectives); stopping")

    def _stop_if_a_late_rank_died(self, c: int, what: str) -> None:
        for r in range(self.n):
            if self._arrived[r] < c and has_died(*self._identities[r]):
                raise CollectiveTimeout(
                    f"rank {self.ranks[self.me]}: rank {self.ranks[r]} (process {self._identities[r][0]}) died "
                    f"while this rank waited for it in a shared-memory {what.split()[0]} over ranks {self.ranks}; "
                    "stopping")

    def _rounds(self, kind: str, x: np.ndarray):
        """(signature, byte offset, byte count) of each round's chunk of x."""
        nbytes = x.nbytes
        step = self.slot_bytes - self.slot_bytes % x.itemsize
        return [(f"{kind} {x.dtype} {nbytes} bytes @{o}", o, min(step, nbytes - o))
                for o in range(0, max(nbytes, 1), step)]

    def all_reduce_sum(self, x: np.ndarray) -> np.ndarray:
        """The sum over the group, added in group-rank order (every rank gets the same bits)."""
        with self._lock:
            return self._all_reduce_sum(x)

    def _all_reduce_sum(self, x: np.ndarray) -> np.ndarray:
        flat = np.ascontiguousarray(x).reshape(-1)
        raw = flat.view(np.uint8)
        out = np.empty_like(flat)
        out_raw = out.view(np.uint8)
        for what, offset, count in self._rounds("all_reduce_sum", flat):
            slots = self._exchange(what, raw[offset:offset + count], True)
            parts = [slots[r, :count].view(flat.dtype) for r in range(self.n)]
            acc = out_raw[offset:offset + count].view(flat.dtype)
            if self.n == 1:
                np.copyto(acc, parts[0])
            else:
                np.add(parts[0], parts[1], out=acc)
            for part in parts[2:]:
                np.add(acc, part, out=acc)
        return out.reshape(x.shape)

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        """[n, *x.shape]: every rank's x in group-rank order."""
        with self._lock:
            flat = np.ascontiguousarray(x).reshape(-1)
            raw = flat.view(np.uint8)
            out = np.empty((self.n, flat.nbytes), np.uint8)
            for what, offset, count in self._rounds("all_gather", flat):
                slots = self._exchange(what, raw[offset:offset + count], True)
                out[:, offset:offset + count] = slots[:, :count]
            return out.view(flat.dtype).reshape((self.n,) + x.shape)

    def broadcast(self, x: np.ndarray, src: int) -> np.ndarray:
        """Group rank `src`'s x on every rank."""
        with self._lock:
            flat = np.ascontiguousarray(x).reshape(-1)
            raw = flat.view(np.uint8)
            out = np.empty(flat.nbytes, np.uint8)
            for what, offset, count in self._rounds(f"broadcast from {src}", flat):
                slots = self._exchange(what, raw[offset:offset + count], self.me == src)
                out[offset:offset + count] = slots[src, :count]
            return out.view(flat.dtype).reshape(x.shape)


def _stop_on_timeout(collective):
    """`collective` that, when it times out, ends this process with its one line: raised, the error
    would cross MindSpore's runtime thread (a pyfunc), which reports it as a long native trace, and
    no further collective can succeed anyway."""
    def run(*args):
        try:
            return collective(*args)
        except CollectiveTimeout as err:
            report(err)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    return run


def primitive(group: ShmGroup, kind: str, *extra):
    """A MindSpore primitive (CPU `pyfunc` Custom op) running `kind` on `group`: "all_reduce_sum"
    (gradient: the all-reduce of the gradient, as MindSpore's AllReduce), "all_gather" (MCCL's
    layout: the ranks' tensors concatenated along dim 0) or "broadcast" (extra: the source's group rank)."""
    from mindspore import ops
    same = lambda shape: shape
    dtype = lambda t: t
    if kind == "all_reduce_sum":
        def bprop(x, out, dout):
            return (op(dout),)
        op = ops.Custom(_stop_on_timeout(group.all_reduce_sum), same, dtype, func_type="pyfunc", bprop=bprop)
        return op
    if kind == "all_gather":
        n = group.n

        def gathered(x):
            every = group.all_gather(x)
            return every.reshape((n * x.shape[0],) + x.shape[1:]) if x.ndim else every
        return ops.Custom(_stop_on_timeout(gathered), lambda shape: [n * shape[0]] + list(shape[1:]) if shape else [n], dtype,
                          func_type="pyfunc")
    if kind == "broadcast":
        (src,) = extra
        return ops.Custom(_stop_on_timeout(lambda x: group.broadcast(x, src)), same, dtype, func_type="pyfunc")
    raise ValueError(f"no shared-memory {kind}")


def process_identity() -> tuple[int, int, int]:
    """(pid, start time in clock ticks, pid namespace inode) of this process: a pid alone may be
    reused, and another namespace's pid means nothing here. (0, 0, 0) where /proc cannot tell."""
    try:
        return os.getpid(), int(_stat_fields("self")[19]), os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0, 0, 0


def has_died(pid: int, start_ticks: int, namespace: int) -> bool:
    """Whether the process of that identity is gone (or a zombie). False when it cannot be told:
    no identity left yet, or a process in another pid namespace."""
    if not pid or namespace != os.stat("/proc/self/ns/pid").st_ino:
        return False
    try:
        fields = _stat_fields(pid)
    except OSError:
        return True
    return fields[0] in ("Z", "X") or int(fields[19]) != start_ticks


def _stat_fields(pid) -> list[str]:
    """/proc/PID/stat's fields after the command name (state first, start time at 19)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


_LOAD_SEEN = {"at": float("-inf"), "idle": True}


def _host_has_idle_cores(now: float) -> bool:
    """Whether the host's run queue (1-minute load average, read at most once a second) fits its
    cores: on a busier host a spinning rank only delays the processes it waits for."""
    if now - _LOAD_SEEN["at"] > 1.0:
        _LOAD_SEEN["at"] = now
        _LOAD_SEEN["idle"] = os.getloadavg()[0] <= (os.cpu_count() or 1) + 0.5
    return _LOAD_SEEN["idle"]
