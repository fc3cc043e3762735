"""A slow link that is alive, from the nodes' TCP round trips (issue 50).

Each agent reports the median and the lowest smoothed round trip of its node's busy TCP
connections (:mod:`dlrover_hpc.agent.tcp_links`).  The kernel's estimate averages every
acknowledged segment, so one heartbeat's reading is already strong evidence, unlike the
heartbeat's own round trip (one request).  A node whose egress is rate-limited queues every
connection's segments: its median, and even its lowest, are many times its peers'.  A peer's
median may count its one connection to the slow node (with three nodes, one in three or in
two), its lowest does not.  A node is slow once the median of its newest :data:`TCP_SAMPLES`
readings of either is :data:`TCP_FACTOR` times its peers' and :data:`MIN_TCP_EXTRA_S` longer:
two readings in three, about 4 s after the onset at the default 2 s heartbeats.  The heartbeat
round trips stay the evidence for agents without it.
"""

from __future__ import annotations

import collections
import statistics

from dlrover_hpc.master.slowness import Slow, slow_links

TCP_SAMPLES = 3
#: Below the heartbeats' 3: a soak with 3 training nodes on 2 busy cores measured medians of
#: 34 ms against its peers' 11 ms at 256 kbit (40 against 5 with 4 nodes); a healthy node's
#: spikes stay under :data:`MIN_TCP_EXTRA_S` (0.2-3.3 ms readings over a healthy minute here).
TCP_FACTOR = 2.5
#: a node's readings count while they are this many heartbeats old at most
TCP_WINDOW_BEATS = 4
MIN_TCP_EXTRA_S = 0.015


class TcpLinks:
    """The nodes' newest TCP round trips in the running round."""

    def __init__(self) -> None:
        #: node -> (at, median, lowest) of its newest readings
        self.samples: dict[str, collections.deque[tuple[float, float, float]]] = {}

    def clear(self) -> None:
        self.samples.clear()

    def sample(self, node: str, at: float, rtt_s: float, min_rtt_s: float = 0.0) -> None:
        readings = self.samples.setdefault(node, collections.deque(maxlen=TCP_SAMPLES))
        readings.append((at, rtt_s, min_rtt_s or rtt_s))

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
        """The nodes' medians (the evidence) and the nodes whose link is slow now: by the
        median of their connections, else by the lowest."""
        medians = self.medians(now, heartbeat_s)
        found: dict[str, Slow] = {}
        for which in (1, 0):
            values = {n: v[which] for n, v in medians.items()}
            for node, s in slow_links(values, factor=TCP_FACTOR).items():
                if s.compute_s - s.peers_compute_s >= MIN_TCP_EXTRA_S:
                    found[node] = s  # the median's evidence, where both found it
        return medians, found
