"""free_port: a port under the kernel's ephemeral range, so no outgoing connection takes it."""

from __future__ import annotations

import socket

from harness import ports


def test_ports_are_free_distinct_enough_and_below_the_ephemeral_range() -> None:
    top = ports._ephemeral_start()
    found = [ports.free_port() for _ in range(50)]
    assert all(ports.LOWEST <= p < top for p in found), found
    assert len(set(found)) > 40  # drawn at random: side-by-side tests rarely meet
    for port in found[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when handed out


def test_a_port_in_use_is_not_handed_out() -> None:
    held = []
    try:
        for _ in range(20):
            sock = socket.socket()
            sock.bind(("127.0.0.1", ports.free_port()))
            sock.listen()
            held.append(sock)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & {ports.free_port() for _ in range(200)}
    finally:
        for sock in held:
            sock.close()
