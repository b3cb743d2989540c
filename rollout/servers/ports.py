"""Ports for the processes a run starts (SGLang servers, the router, rendezvous and weight-update
groups): free now, and outside the range the kernel hands to outgoing connections.

    from rollout.servers.ports import free_port
    port = free_port("127.0.0.1")
"""
from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; else its default)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now, below the kernel's ephemeral range.

    A server binds its port tens of seconds after the port is chosen (SGLang: 20-50 s on CPU), and
    the launcher polls that port meanwhile. A port from the ephemeral range (what `bind(host, 0)`
    hands out) can be taken in that window by any outgoing connection, the poll included: a
    connect whose local port happens to equal the refused destination port connects to itself
    (TCP simultaneous open) and holds the port, and the server then fails with "address already in
    use" (seen once in this project's test runs). Ports below the range are handed to nobody but
    an explicit bind."""
    lo, _ = _ephemeral_range()
    start = 10000 if lo > 20000 else 1024
    # the system's RNG: a run seeds `random`, and two runs seeded alike must not pick alike
    for port in random.SystemRandom().sample(range(start, lo), max(0, min(200, lo - start))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # all tried were taken
        s.bind((host, 0))
        return s.getsockname()[1]
