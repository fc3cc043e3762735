"""The node's TCP connections as the kernel measures them: a slow link that is alive (issue 50).

A node whose egress is rate-limited (a bad cable, a port at a fraction of its speed; on the
local Slurm ``tc tbf``) loses no packet: every one is acknowledged, late.  Its workers' step
times say nothing about it, as every rank waits for it in the all-reduce.  The kernel does:
each TCP connection's smoothed round trip (``TCP_INFO``) counts the time its segments wait in
the node's queue.  On the slow node every connection that sends shows it; on a peer, only the
one connection to that node.  So the agent reads every connection of its node (``ss -tin``:
netlink ``sock_diag``, nothing asked of the workers) at each heartbeat and reports the median
round trip over the connections to other hosts that sent a few segments since the previous
heartbeat (:data:`MIN_SEGMENTS`), and the lowest: on the slow node even that queues, while a
peer's lowest is a connection to a healthy node (its median may count its connection to the
slow one).  The master compares the nodes' lowest readings
(:mod:`dlrover_hpc.master.link_slowness`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import shutil
import statistics
import subprocess

log = logging.getLogger(__name__)

SS_TIMEOUT_S = 2.0
_RTT = re.compile(r"\brtt:([0-9.]+)/")
_LASTSND = re.compile(r"\blastsnd:(\d+)")
_LOCAL = ("127.", "[::1]", "[::ffff:127.")


@dataclasses.dataclass(frozen=True, slots=True)
class Links:
    """The median and the lowest smoothed round trip of the busy connections, and how many
    there were."""

    rtt_s: float = 0.0
    count: int = 0
    min_rtt_s: float = 0.0


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].removeprefix("[::ffff:").rstrip("]").lstrip("[")


#: a connection counts when it sent this many data segments since the previous reading: the
#: kernel's estimate moves by an eighth per acknowledged one, so a connection that sends once
#: per heartbeat (the agent's own, to the master), or only acknowledgements (a ring's link
#: from the previous rank), lags the onset by several heartbeats
MIN_SEGMENTS = 8
_SEGS = re.compile(r"\bdata_segs_out:(\d+)")


def summarize(
    text: str, *, recent_ms: float, before: dict[tuple[str, str], int] | None = None
) -> tuple[Links, dict[tuple[str, str], int]]:
    """``ss -tinH`` output -> the round trips over the established connections to another
    host that sent :data:`MIN_SEGMENTS` data segments since ``before`` (each connection's
    segments then; None: that sent within ``recent_ms``), and each connection's segments now."""
    rtts, segments = [], {}
    lines = text.splitlines()
    for head, info in itertools.pairwise(lines):
        fields = head.split()
        if len(fields) < 5 or fields[0] != "ESTAB" or not info[:1].isspace():
            continue
        local, peer = fields[3], fields[4]
        if peer.startswith(_LOCAL) or _host(local) == _host(peer):
            continue  # the node's own ranks, over loopback or its own address
        rtt, lastsnd, segs = _RTT.search(info), _LASTSND.search(info), _SEGS.search(info)
        if rtt is None or lastsnd is None or segs is None:
            continue
        segments[local, peer] = sent = int(segs.group(1))
        if before is None:
            busy = int(lastsnd.group(1)) <= recent_ms
        else:
            busy = sent - before.get((local, peer), sent) >= MIN_SEGMENTS
        if busy:
            rtts.append(float(rtt.group(1)) / 1000.0)
    if not rtts:
        return Links(), segments
    return Links(round(statistics.median(rtts), 6), len(rtts), round(min(rtts), 6)), segments


class TcpLinks:
    """Reads the node's connections with ``ss``; reports nothing where it cannot run."""

    def __init__(self) -> None:
        self._ss = shutil.which("ss")
        self._segments: dict[tuple[str, str], int] | None = None
        if self._ss is None:
            log.info("no 'ss' (iproute2) here: no TCP round trips in the heartbeats")

    def read(self) -> Links:
        """The connections that sent :data:`MIN_SEGMENTS` data segments since the last read."""
        if self._ss is None:
            return Links()
        try:
            out = subprocess.run(
                [self._ss, "-tinH"],
                capture_output=True,
                text=True,
                timeout=SS_TIMEOUT_S,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("ss failed error=%s: no TCP round trips in the heartbeats", exc)
            self._ss = None
            return Links()
        first = self._segments is None
        links, self._segments = summarize(out, recent_ms=0.0, before=self._segments or {})
        return Links() if first else links
