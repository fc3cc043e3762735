"""The node's TCP round trips: the rule on connections captured verbatim with ``ss -tinH`` on
the local Slurm (a 4-node DDP job; node3's control link rate-limited to 256 kbit with tbf, 11 s
in), and the in-process netlink reading against the kernel's own ``TCP_INFO`` of real sockets."""

from __future__ import annotations

import dataclasses
import errno
import itertools
import re
import socket
import struct
import time
from pathlib import Path

import pytest

from dlrover_hpc.agent import tcp_links
from dlrover_hpc.agent.tcp_links import Conn, Links, TcpLinks, parse_dump, summarize

DATA = Path(__file__).parents[1] / "data" / "tcp"


def _from_ss(text: str) -> list[Conn]:
    """``ss -tinH``'s established connections (the fields the agent reads over netlink)."""
    conns = []
    for head, info in itertools.pairwise(text.splitlines()):
        fields = head.split()
        if len(fields) < 5 or fields[0] != "ESTAB" or not info[:1].isspace():
            continue
        found = [re.search(rf"\b{k}:([0-9.]+)", info) for k in ("rtt", "lastsnd", "data_segs_out")]
        if all(found):
            rtt, lastsnd, segs = (float(f.group(1)) for f in found if f)
            local, peer = (a.replace("[::ffff:", "").replace("]", "") for a in fields[3:5])
            conns.append(Conn(local, peer, round(rtt * 1000), int(lastsnd), int(segs)))
    return conns


def _ss(capture: str) -> list[Conn]:
    return _from_ss((DATA / capture).read_text())


@pytest.mark.parametrize(
    ("capture", "recent_ms", "links"),
    [
        # node3 (slow egress): its gloo data to node2 (68.8 ms), its acks and data to node4
        # (40.4), its heartbeats to the master (22.3); two idle connections left out
        ("ss-tin-slow-egress.txt", 2000, Links(0.040375, 3, 0.022308)),
        # node4, a peer: only its connection to node3 queues (44.3 ms); node1's two 4.6-4.8
        ("ss-tin-peer.txt", 2000, Links(0.004798, 3, 0.004592)),
        # only connections that sent in the last 50 ms: node4's two at lastsnd 12 ms
        ("ss-tin-peer.txt", 50, Links(round((0.044272 + 0.004798) / 2, 6), 2, 0.004798)),
        ("ss-tin-peer.txt", 1, Links()),  # nothing sent that recently
    ],
)
def test_the_median_round_trip_of_the_connections_that_sent(
    capture: str, recent_ms: float, links: Links
) -> None:
    assert summarize(_ss(capture), recent_ms=recent_ms)[0] == links


def test_between_two_readings_only_connections_that_sent_segments_count() -> None:
    """The kernel's estimate moves an eighth per acknowledged data segment: a connection that
    sent one since (the agent's own, once per heartbeat), or only acknowledgements, would lag
    the onset."""
    conns = _ss("ss-tin-slow-egress.txt")
    _, now = summarize(conns, recent_ms=0.0)
    data = ("10.77.7.3:59046", "10.77.7.2:34919")  # node3's gloo data to node2: 68.8 ms
    master = ("10.77.7.3:43106", "10.77.7.1:34185")  # its heartbeats: 22.3 ms
    assert now[data] == 4172 and now[master] == 61  # data_segs_out
    before = {**now, data: now[data] - 40, master: now[master] - 1}
    assert summarize(conns, recent_ms=0.0, before=before)[0] == Links(0.068768, 1, 0.068768)
    assert summarize(conns, recent_ms=0.0, before=now)[0] == Links()  # nothing sent since
    assert summarize(conns, recent_ms=0.0, before={})[0] == Links()  # all new: no baseline


def test_segments_are_counted_over_two_seconds_at_least_whatever_the_heartbeat() -> None:
    """At 1 s heartbeats a link slowed to a few steps a second sends fewer than
    MIN_SEGMENTS between two readings: they are counted from the reading 2 s old."""
    conns = _ss("ss-tin-slow-egress.txt")
    data = ("10.77.7.3:59046", "10.77.7.2:34919")  # node3's gloo data to node2: 68.8 ms
    sent = {"segments": conns[0].data_segs_out}  # any start; each read adds 5 to its data
    clock = {"now": 100.0}

    def source() -> list[Conn]:
        sent["segments"] += 5
        return [
            dataclasses.replace(c, data_segs_out=sent["segments"])
            if (c.local, c.peer) == data
            else c
            for c in conns
        ]

    links = TcpLinks(source, clock=lambda: clock["now"])
    readings = []
    for _ in range(5):  # 1 s apart: 5 segments each, under MIN_SEGMENTS = 8
        readings.append(links.read())
        clock["now"] += 1.0
    assert readings[0] == Links()  # the first: the baseline
    assert readings[1] == Links()  # 1 s: 5 segments, from the only reading there is
    slow = Links(0.068768, 1, 0.068768)  # 2 s and more: 10 segments
    assert readings[2:] == [slow, slow, slow]
    assert tcp_links.SEGMENT_SPAN_S == 2.0 and tcp_links.MIN_SEGMENTS == 8
    clock["now"] += 7.0  # a heartbeat 8 s apart (4,096 nodes): from the previous reading
    assert links.read() == Links()  # 5 segments in 8 s: idle
    assert [at for at, _ in links._readings] == [104.0, 112.0]  # older ones dropped


def test_the_nodes_own_ranks_count_for_nothing() -> None:
    def conn(local: str, peer: str) -> Conn:
        return Conn(local, peer, rtt_us=90_000, last_data_sent_ms=5, data_segs_out=9)

    own = [
        conn("127.0.0.1:5000", "127.0.0.1:5001"),
        conn("10.77.7.3:5000", "10.77.7.3:5002"),  # its own address
        conn("[::1]:5000", "[::1]:5003"),
        conn("[fd00::3]:5000", "[fd00::3]:5004"),
    ]
    assert summarize(own, recent_ms=2000) == (Links(), {})
    other = Conn("[fd00::3]:5000", "[fd00::2]:5005", 3000, 5, 9)
    assert summarize([*own, other], recent_ms=2000)[0] == Links(0.003, 1, 0.003)
    assert summarize([], recent_ms=2000) == (Links(), {})


def _tcp_info(sock: socket.socket) -> tuple[int, int]:
    """The kernel's smoothed round trip (us) and data segments sent, as the socket reads them."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return struct.unpack_from("=I", info, 68)[0], struct.unpack_from("=I", info, 156)[0]


@pytest.mark.parametrize(
    ("family", "host"), [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]
)
def test_netlink_reads_what_each_socket_reads_of_itself(family: int, host: str) -> None:
    with socket.create_server((host, 0), family=family) as server:
        client = socket.create_connection(server.getsockname()[:2])
        accepted, _ = server.accept()
        with client, accepted:
            for _ in range(12):
                client.send(b"x" * 100)
                accepted.recv(1000)
                time.sleep(0.002)
            time.sleep(0.05)  # the last acknowledgement in: nothing moves while both read
            local, peer = client.getsockname()[:2], client.getpeername()[:2]
            name = (f"{local[0]}:{local[1]}", f"{peer[0]}:{peer[1]}")
            if family == socket.AF_INET6:
                name = (f"[{local[0]}]:{local[1]}", f"[{peer[0]}]:{peer[1]}")
            found = {(c.local, c.peer): c for c in tcp_links.connections()}
            rtt_us, segs = _tcp_info(client)
    conn = found[name]
    assert (conn.rtt_us, conn.data_segs_out) == (rtt_us, segs) and segs >= 12
    assert conn.last_data_sent_ms < 5000
    assert (name[1], name[0]) in found  # the accepted end, too


def _message(kind: int, body: bytes) -> bytes:
    data = struct.pack("=IHHII", 16 + len(body), kind, 0, 1, 0) + body
    return data + bytes(-len(data) % 4)


def test_a_dump_ends_on_done_and_an_error_answer_raises_its_errno() -> None:
    assert parse_dump(_message(3, struct.pack("=i", 0))) == ([], True)
    assert parse_dump(_message(20, bytes(10))) == ([], False)  # too short: not a socket
    with pytest.raises(OSError) as raised:
        parse_dump(_message(2, struct.pack("=i", -errno.EPERM) + bytes(16)))
    assert raised.value.errno == errno.EPERM
    with pytest.raises(OSError, match="netlink message of 400 bytes"):
        parse_dump(struct.pack("=IHHII", 400, 20, 0, 1, 0))  # cut off


def test_reads_this_hosts_connections_from_a_baseline() -> None:
    links = TcpLinks()
    assert links.read() == Links()  # the first reading: each connection's baseline
    assert links.read().count >= 0  # whatever this host holds, it parses
