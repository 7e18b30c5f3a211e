"""Networking helpers shared by launchers, trainers and tests."""
import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
