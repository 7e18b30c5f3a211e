"""A worker joins msrun's cluster only once the scheduler listens.

msrun starts the scheduler and the workers at the same moment, each running the user's script. A
worker whose `mindspore.communication.init()` reaches the scheduler's port before the scheduler
listens fails its first registration, and MindSpore 2.10's reconnect then keeps failing for about
10 s before a registration goes through (docs/mindspore.md): every such launch starts 10 s late.
Waiting here for the port to accept a plain TCP connection makes the first registration succeed,
unless the scheduler is slow between listening and running its event loop (starved of CPU, or
its libraries not yet in the page cache): registrations in between fail and MindSpore retries
them every 0.5 s. Seen with the scheduler at nice 19 under load 10 (its event loop started 0.35 s
after it listened) and in the first launch after installing MindSpore.

Each process of the cluster also sends a heartbeat every 3-5 s (MindSpore's default), and its exit
waits for the heartbeat thread's current sleep to end, the scheduler's for the workers' last
heartbeat: a launch ended 5-7 s after its workers' work. One second between heartbeats, unless the
user set MindSpore's variables, ends it within about 2 s.
"""
from __future__ import annotations

import os
import socket
import time

POLL_S = 0.05
# past this, init() runs anyway and MindSpore's own timeout and message apply
GIVE_UP_S = 120.0


HEARTBEAT_S = "1"


def quicker_heartbeat(environ=os.environ) -> None:
    """One heartbeat a second where the user left MindSpore's interval unset (read by init())."""
    if not environ.get("MS_RETRY_INTERVAL_LOWER") and not environ.get("MS_RETRY_INTERVAL_UPPER"):
        environ["MS_RETRY_INTERVAL_LOWER"] = environ["MS_RETRY_INTERVAL_UPPER"] = HEARTBEAT_S


def scheduler_address() -> tuple[str, int] | None:
    """Where msrun's scheduler listens, for a worker msrun started (None for anything else)."""
    if os.environ.get("MS_ROLE") != "MS_WORKER":
        return None
    host, port = os.environ.get("MS_SCHED_HOST"), os.environ.get("MS_SCHED_PORT")
    if not host or not port or not port.isdigit():
        return None
    return host, int(port)


def wait_for_scheduler(address: tuple[str, int] | None, give_up_s: float = GIVE_UP_S) -> bool:
    """Block until `address` accepts a TCP connection (True), or give_up_s passed (False)."""
    if address is None:
        return False
    deadline = time.monotonic() + give_up_s
    while True:
        try:
            with socket.create_connection(address, timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
