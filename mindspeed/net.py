"""Networking helpers shared by launchers, trainers and tests."""
import random
import socket

_FALLBACK_RANGE = (32768, 60999)


def _ephemeral_range() -> tuple:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _FALLBACK_RANGE


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a local rendezvous).

    Drawn below the kernel's ephemeral range: a port the kernel hands out (bind to port 0) can be
    taken again, before the rendezvous binds it, by any outgoing connection on the machine (gloo
    opens many), which showed up as EADDRINUSE when tests ran side by side."""
    low, _ = _ephemeral_range()
    if low > 12000:
        for _ in range(50):
            port = random.randint(10000, low - 1)
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
