"""A slow link that is alive, from the nodes' TCP round trips (issue 50).

Each agent reports the median smoothed round trip of its node's busy TCP connections
(:mod:`dlrover_hpc.agent.tcp_links`).  The kernel's estimate averages every acknowledged
segment, so one heartbeat's reading is already strong evidence, unlike the heartbeat's own
round trip (one request).  A node whose egress is rate-limited queues every connection's
segments: its median is many times its peers' (whose median covers one connection to it at
most among the others).  A node is slow once the median of its newest :data:`TCP_SAMPLES`
readings is :data:`TCP_FACTOR` times its peers' and :data:`MIN_TCP_EXTRA_S` longer: two
readings in three, about 4 s after the onset at the default 2 s heartbeats.  The heartbeat
round trips stay the evidence for agents without it.
"""

from __future__ import annotations

import collections
import statistics

from dlrover_hpc.master.slowness import Slow, slow_links

TCP_SAMPLES = 3
#: Below the heartbeats' 3: each peer's median counts its one connection to the slow node,
#: which queues too (a soak with 3 training nodes on 2 busy cores measured 34 ms against its
#: peers' 11 ms at 256 kbit; 40 ms against 5 ms with 4 nodes); a healthy node's spikes stay
#: under :data:`MIN_TCP_EXTRA_S` (0.2-3.3 ms readings over a healthy minute here).
TCP_FACTOR = 2.5
#: a node's readings count while they are this many heartbeats old at most
TCP_WINDOW_BEATS = 4
MIN_TCP_EXTRA_S = 0.015


class TcpLinks:
    """The nodes' newest TCP round trips in the running round."""

    def __init__(self) -> None:
        self.samples: dict[str, collections.deque[tuple[float, float]]] = {}

    def clear(self) -> None:
        self.samples.clear()

    def sample(self, node: str, at: float, rtt_s: float) -> None:
        self.samples.setdefault(node, collections.deque(maxlen=TCP_SAMPLES)).append((at, rtt_s))

    def medians(self, now: float, heartbeat_s: float) -> dict[str, float]:
        """Each node's median of its newest readings, where it has :data:`TCP_SAMPLES`
        recent enough."""
        window = TCP_WINDOW_BEATS * heartbeat_s
        out = {}
        for node, samples in self.samples.items():
            recent = [r for at, r in samples if now - at <= window]
            if len(recent) >= TCP_SAMPLES:
                out[node] = statistics.median(recent)
        return out

    def check(self, now: float, heartbeat_s: float) -> tuple[dict[str, float], dict[str, Slow]]:
        """The nodes' medians (the evidence) and the nodes whose link is slow now."""
        medians = self.medians(now, heartbeat_s)
        slow = slow_links(medians, factor=TCP_FACTOR)
        return medians, {
            n: s for n, s in slow.items() if s.compute_s - s.peers_compute_s >= MIN_TCP_EXTRA_S
        }
