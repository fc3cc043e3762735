"""A slow link that is alive, from the nodes' TCP round trips (issue 50).

Each agent reports the median and the lowest smoothed round trip of its node's busy TCP
connections (:mod:`dlrover_hpc.agent.tcp_links`).  The kernel's estimate averages every
acknowledged segment, so one heartbeat's reading is already strong evidence, unlike the
heartbeat's own round trip (one request).  A node whose egress is rate-limited queues every
connection's segments: even its lowest round trip is many times its peers'.  Not its median
alone: a peer's median counts its connection to the slow node, which queues too (a soak saw
a healthy node's median at 23 ms, its lowest 0.3 ms, beside the slow node's 40 and 32).  A
node is slow once the median of its newest :data:`TCP_SAMPLES` lowest readings, each over
:data:`MIN_CONNECTIONS` connections at least, is :data:`TCP_FACTOR` times its peers' and
:data:`MIN_TCP_EXTRA_S` longer: two readings in three, about 2 s after the onset at the
1 s heartbeats of a job up to 512 nodes (4-5 s at 2 s heartbeats).  The heartbeat round trips
stay the evidence for agents without it.
"""

from __future__ import annotations

import collections
import statistics

from dlrover_hpc.master.slowness import Slow, slow_links

TCP_SAMPLES = 3
#: the slow node's lowest was 8-40 times its peers' in the soaks here (18-32 ms against 0.5-3)
TCP_FACTOR = 2.5
#: a healthy node's lowest stayed under 11 ms in the soaks on 2 busy cores
MIN_TCP_EXTRA_S = 0.012
#: a node with one busy connection, to the slow node, would be its lowest alone
MIN_CONNECTIONS = 2
#: a node's readings count while they are this many heartbeats old at most
TCP_WINDOW_BEATS = 4


class TcpLinks:
    """The nodes' newest TCP round trips in the running round."""

    def __init__(self) -> None:
        #: node -> (at, median, lowest) of its newest readings
        self.samples: dict[str, collections.deque[tuple[float, float, float]]] = {}

    def clear(self) -> None:
        self.samples.clear()

    def sample(
        self, node: str, at: float, rtt_s: float, min_rtt_s: float, connections: int
    ) -> None:
        if connections >= MIN_CONNECTIONS:
            readings = self.samples.setdefault(node, collections.deque(maxlen=TCP_SAMPLES))
            readings.append((at, rtt_s, min_rtt_s))

    def medians(self, now: float, heartbeat_s: float) -> dict[str, tuple[float, float]]:
        """Each node's median of its newest readings (of the median, of the lowest), where
        it has :data:`TCP_SAMPLES` recent enough."""
        window = TCP_WINDOW_BEATS * heartbeat_s
        out = {}
        for node, samples in self.samples.items():
            recent = [(r, low) for at, r, low in samples if now - at <= window]
            if len(recent) >= TCP_SAMPLES:
                out[node] = (
                    statistics.median(r for r, _ in recent),
                    statistics.median(low for _, low in recent),
                )
        return out

    def check(
        self, now: float, heartbeat_s: float
    ) -> tuple[dict[str, tuple[float, float]], dict[str, Slow]]:
        """The nodes' medians (the evidence) and the nodes whose link is slow now, by their
        lowest round trips."""
        medians = self.medians(now, heartbeat_s)
        lowest = {n: low for n, (_, low) in medians.items()}
        slow = slow_links(lowest, factor=TCP_FACTOR)
        return medians, {
            n: s for n, s in slow.items() if s.compute_s - s.peers_compute_s >= MIN_TCP_EXTRA_S
        }
