"""The node's TCP round trips from ``ss -tinH``, on output captured verbatim on the local Slurm
(a 4-node DDP job; node3's control link rate-limited to 256 kbit with tbf, 11 s in)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrover_hpc.agent.tcp_links import Links, TcpLinks, summarize

DATA = Path(__file__).parents[1] / "data" / "tcp"


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
    assert summarize((DATA / capture).read_text(), recent_ms=recent_ms)[0] == links


def test_between_two_readings_only_connections_that_sent_segments_count() -> None:
    """The kernel's estimate moves an eighth per acknowledged data segment: a connection that
    sent one since (the agent's own, once per heartbeat), or only acknowledgements, would lag
    the onset."""
    text = (DATA / "ss-tin-slow-egress.txt").read_text()
    _, now = summarize(text, recent_ms=0.0)
    data = ("10.77.7.3:59046", "10.77.7.2:34919")  # node3's gloo data to node2: 68.8 ms
    master = ("10.77.7.3:43106", "10.77.7.1:34185")  # its heartbeats: 22.3 ms
    assert now[data] == 4172 and now[master] == 61  # data_segs_out
    before = {**now, data: now[data] - 40, master: now[master] - 1}
    assert summarize(text, recent_ms=0.0, before=before)[0] == Links(0.068768, 1, 0.068768)
    assert summarize(text, recent_ms=0.0, before=now)[0] == Links()  # nothing sent since
    assert summarize(text, recent_ms=0.0, before={})[0] == Links()  # all new: no baseline


def test_the_nodes_own_ranks_and_lines_that_are_no_connection_count_for_nothing() -> None:
    info = "\t bbr rtt:90.0/1.0 lastsnd:5 bytes_acked:100 data_segs_out:9\n"
    text = (
        "ESTAB 0 0 127.0.0.1:5000 127.0.0.1:5001\n"
        + info
        + "ESTAB 0 0 10.77.7.3:5000 10.77.7.3:5002\n"
        + info  # its own address
        + "ESTAB 0 0 [::ffff:127.0.0.1]:5000 [::ffff:127.0.0.1]:5003\n"
        + info
        + "LISTEN 0 128 0.0.0.0:22 0.0.0.0:*\n"
        + info
        + "ESTAB 0 0 10.77.7.3:5000 10.77.7.4:5004\n"  # no info line after it
        + "ESTAB 0 0 10.77.7.3:5000 10.77.7.2:5005\n\t bbr rtt:3.0/1.0 lastsnd:5\n"
    )
    assert summarize(text, recent_ms=2000)[0] == Links()  # the last: no data_segs_out
    text = text.replace("lastsnd:5\n", "lastsnd:5 data_segs_out:9\n")
    assert summarize(text, recent_ms=2000)[0] == Links(0.003, 1, 0.003)
    assert summarize("", recent_ms=2000) == (Links(), {})


def test_reads_this_hosts_connections_or_nothing_where_ss_cannot_run() -> None:
    links = TcpLinks()
    assert links.read() == Links()  # the first reading: each connection's baseline
    assert links.read().count >= 0  # whatever this host holds, it parses
    links._ss = "/nonexistent/ss"
    assert links.read() == Links()
    assert links._ss is None  # not tried again at every heartbeat
