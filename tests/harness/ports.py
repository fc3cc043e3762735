"""A free TCP port for a test's server, from outside the kernel's ephemeral range.

A port found by binding port 0 comes from the ephemeral range, which every outgoing
connection on the machine also draws from: between the test's check and its server's bind, a
connection of a test beside it can take the port (a CI run saw a TCPStore fail with
EADDRINUSE so).  Ports below that range are handed out only to servers that name them.
"""

from __future__ import annotations

import random
import socket

#: the lowest port handed out; under it are the well-known services a machine may run
LOWEST = 20000
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_RANDOM = random.SystemRandom()  # not the test's seeded generator: workers side by side differ


def _ephemeral_start() -> int:
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port under the ephemeral range that nothing on ``host`` is bound to now."""
    top = _ephemeral_start()
    if top - LOWEST < 1000:  # a range opened wide: take the kernel's word
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])
    for _ in range(200):
        port = _RANDOM.randrange(LOWEST, top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} in {LOWEST}-{top - 1} after 200 tries")
