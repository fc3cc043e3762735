"""The node's TCP connections as the kernel measures them: a slow link that is alive (issue 50).

A node whose egress is rate-limited (a bad cable, a port at a fraction of its speed; on the
local Slurm ``tc tbf``) loses no packet: every one is acknowledged, late.  Its workers' step
times say nothing about it, as every rank waits for it in the all-reduce.  The kernel does:
each TCP connection's smoothed round trip (``TCP_INFO``) counts the time its segments wait in
the node's queue.  On the slow node every connection that sends shows it; on a peer, only the
one connection to that node.  So the agent reads every connection of its node at each
heartbeat and reports the median round trip over the connections to other hosts that sent a
few segments in the last seconds (:data:`MIN_SEGMENTS` over :data:`SEGMENT_SPAN_S` at least),
and the lowest: on the slow node even that queues, while a peer's lowest is a connection to a
healthy node (its median may count its connection to the slow one).  The master compares the
nodes' lowest readings (:mod:`dlrover_hpc.master.link_slowness`).

The connections are read in this process over netlink (``sock_diag``, what ``ss -tin`` asks),
never by starting ``ss``: a forked child closes the agent's inherited descriptors, and on a
FUSE or NFS mount each close is a flush that waits for the server.  While storage hangs, the
child would hang before it ran, and the heartbeat with it (a node reported lost for its
storage).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import ipaddress
import logging
import socket
import statistics
import struct
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: a connection counts when it sent this many data segments since the previous reading: the
#: kernel's estimate moves by an eighth per acknowledged one, so a connection that sends once
#: per heartbeat (the agent's own, to the master), or only acknowledgements (a ring's link
#: from the previous rank), lags the onset by several heartbeats
MIN_SEGMENTS = 8
#: ... counted from the newest reading at least this old (the oldest kept, while none is): at
#: 1 s heartbeats a link slowed to a few steps a second sends fewer than 8 between two
SEGMENT_SPAN_S = 2.0
NETLINK_TIMEOUT_S = 2.0

# <linux/netlink.h>, <linux/sock_diag.h>, <linux/inet_diag.h>, <linux/tcp.h>
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST_DUMP = 0x001 | 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_INET_DIAG_INFO = 2
_TCP_ESTABLISHED = 1
_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_REQ = struct.Struct("=BBBBI48x")  # inet_diag_req_v2: family, protocol, ext, pad, states, id
_MSG = struct.Struct("=BBBB2s2s16s16s")  # inet_diag_msg: family .. the sockid's addresses
_MSG_SIZE = 72  # inet_diag_msg: 4 + its 48-byte sockid + expires, queues, uid, inode
_RTA = struct.Struct("=HH")  # rtattr: len, type
# struct tcp_info: tcpi_last_data_sent (ms ago), tcpi_rtt (us), tcpi_data_segs_out (Linux 4.6)
_U32 = struct.Struct("=I")
_AT_LAST_DATA_SENT, _AT_RTT, _AT_DATA_SEGS_OUT = 44, 68, 156


@dataclasses.dataclass(frozen=True, slots=True)
class Conn:
    """One established connection: its ends (``host:port``), the kernel's smoothed round trip,
    how long ago it last sent data and how many data segments it sent in all."""

    local: str
    peer: str
    rtt_us: int
    last_data_sent_ms: int
    data_segs_out: int


@dataclasses.dataclass(frozen=True, slots=True)
class Links:
    """The median and the lowest smoothed round trip of the busy connections, and how many
    there were."""

    rtt_s: float = 0.0
    count: int = 0
    min_rtt_s: float = 0.0


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def _is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


def summarize(
    conns: list[Conn], *, recent_ms: float, before: dict[tuple[str, str], int] | None = None
) -> tuple[Links, dict[tuple[str, str], int]]:
    """The round trips over the established connections to another host that sent
    :data:`MIN_SEGMENTS` data segments since ``before`` (each connection's segments then; None:
    that sent within ``recent_ms``), and each connection's segments now."""
    rtts, segments = [], {}
    for c in conns:
        host = _host(c.local)
        if _is_loopback(_host(c.peer)) or host == _host(c.peer):
            continue  # the node's own ranks, over loopback or its own address
        segments[c.local, c.peer] = c.data_segs_out
        if before is None:
            busy = c.last_data_sent_ms <= recent_ms
        else:
            busy = c.data_segs_out - before.get((c.local, c.peer), c.data_segs_out) >= MIN_SEGMENTS
        if busy:
            rtts.append(c.rtt_us / 1e6)
    if not rtts:
        return Links(), segments
    return Links(round(statistics.median(rtts), 6), len(rtts), round(min(rtts), 6)), segments


def _address(family: int, raw: bytes, port: bytes) -> str:
    if family == socket.AF_INET:
        host = socket.inet_ntop(socket.AF_INET, raw[:4])
    else:
        ip = ipaddress.IPv6Address(raw)
        if ip.ipv4_mapped is None:
            return f"[{ip}]:{int.from_bytes(port, 'big')}"
        host = str(ip.ipv4_mapped)  # a dual-stack socket's IPv4 peer, as IPv4
    return f"{host}:{int.from_bytes(port, 'big')}"


def parse_dump(data: bytes) -> tuple[list[Conn], bool]:
    """One ``recv`` of a ``SOCK_DIAG_BY_FAMILY`` dump -> its connections, and whether the dump
    ended in it.  A kernel's error answer raises :class:`OSError` with its errno."""
    conns, off, done = [], 0, False
    while off + _NLMSG.size <= len(data):
        length, kind = _NLMSG.unpack_from(data, off)[:2]
        if length < _NLMSG.size or off + length > len(data):
            raise OSError(errno.EBADMSG, f"a netlink message of {length} bytes at {off}")
        body, off = data[off + _NLMSG.size : off + length], off + ((length + 3) & ~3)
        if kind == _NLMSG_DONE:
            done = True
            break
        if kind == _NLMSG_ERROR:
            code = -struct.unpack_from("=i", body)[0]
            raise OSError(code, f"sock_diag: {errno.errorcode.get(code, code)}")
        if kind != _SOCK_DIAG_BY_FAMILY or len(body) < _MSG_SIZE:
            continue
        family, _state, _, _, sport, dport, src, dst = _MSG.unpack_from(body)
        info, at = None, _MSG_SIZE
        while at + _RTA.size <= len(body):
            rta_len, rta_type = _RTA.unpack_from(body, at)
            if rta_len < _RTA.size:
                break
            if rta_type == _INET_DIAG_INFO:
                info = body[at + _RTA.size : at + rta_len]
            at += (rta_len + 3) & ~3
        if info is None or len(info) < _AT_DATA_SEGS_OUT + 4:
            continue  # no tcp_info, or one from before Linux 4.6 (no data_segs_out)
        conns.append(
            Conn(
                local=_address(family, src, sport),
                peer=_address(family, dst, dport),
                rtt_us=_U32.unpack_from(info, _AT_RTT)[0],
                last_data_sent_ms=_U32.unpack_from(info, _AT_LAST_DATA_SENT)[0],
                data_segs_out=_U32.unpack_from(info, _AT_DATA_SEGS_OUT)[0],
            )
        )
    return conns, done


def connections() -> list[Conn]:
    """This network namespace's established TCP connections (IPv4 and IPv6), from the kernel."""
    conns: list[Conn] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(NETLINK_TIMEOUT_S)
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), start=1):
            req = _REQ.pack(
                family, socket.IPPROTO_TCP, 1 << (_INET_DIAG_INFO - 1), 0, 1 << _TCP_ESTABLISHED
            )
            sock.send(
                _NLMSG.pack(
                    _NLMSG.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, seq, 0
                )
                + req
            )
            done = False
            while not done:
                part, done = parse_dump(sock.recv(1 << 16))
                conns.extend(part)
    return conns


class TcpLinks:
    """Reads the node's connections; reports nothing where the kernel will not tell."""

    def __init__(
        self,
        source: Callable[[], list[Conn]] = connections,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source, self._clock = source, clock
        #: (when, each connection's segments then) of the recent readings, oldest first
        self._readings: collections.deque[tuple[float, dict[tuple[str, str], int]]] = (
            collections.deque()
        )
        self._failed = False

    def _baseline(self, now: float) -> dict[tuple[str, str], int] | None:
        """The newest reading :data:`SEGMENT_SPAN_S` old at least (older ones dropped), or
        the oldest; None before the first."""
        while len(self._readings) > 1 and now - self._readings[1][0] >= SEGMENT_SPAN_S:
            self._readings.popleft()
        return self._readings[0][1] if self._readings else None

    def read(self) -> Links:
        """The connections that sent :data:`MIN_SEGMENTS` data segments since the newest
        reading :data:`SEGMENT_SPAN_S` old (or the oldest there is)."""
        if self._failed:
            return Links()
        try:
            conns = self._source()
        except OSError as exc:  # no sock_diag (a kernel without it, a sandbox that denies it)
            log.warning(
                "cannot read TCP connections error=%s: no TCP round trips in the heartbeats", exc
            )
            self._failed = True
            return Links()
        now = self._clock()
        before = self._baseline(now)
        links, segments = summarize(conns, recent_ms=0.0, before=before or {})
        self._readings.append((now, segments))
        return Links() if before is None else links
