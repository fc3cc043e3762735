"""Cross-node memory replicas of checkpoint segments (``replica_count``).

A node's flash checkpoint lives in its ``/dev/shm`` and dies with the node.  With
``replica_count=N`` the agent copies each segment its ranks finish to N peer nodes in the
background (:class:`ReplicaSender`), where the peer's agent keeps it as ``<prefix>c<name>``
(:class:`ReplicaServer`).  A restore lists those copies with the node's own segments, so a
replacement node receives the lost parts from a peer's memory (``restore_agreement``).

The sender never locks a segment (training must not wait for a copy): it sends the bytes as
they are and then reads the header again; if a save began meanwhile (state or ``seq``
changed) the copy is dropped on the peer (a seqlock).  The peer receives into a temporary
file and renames it over the previous copy only when the copy is whole and its header names
the announced step, so a reader never sees half a copy.

Wire (TCP, one connection per peer, kept open; JSON frames are a 4-byte big-endian length
and UTF-8 JSON, at most 64 KiB): the server sends a 32-byte nonce, the client answers
HMAC-SHA256(job token, CONTEXT + nonce), a wrong answer is hung up on.  Per copy: ``{name,
step, seq, size, node}`` -> ``{ok}`` or ``{ok: false, error}`` (refused before a byte is
sent: a bad name or size, the memory limit, no space), then ``size`` raw bytes and one
trailer byte (1: intact, 0: torn) -> ``{ok}`` or ``{ok: false, error}``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import mmap
import os
import re
import secrets
import socket
import struct
import threading
import time
from typing import Any, TypeGuard

from dlrover_hpc.checkpoint.api import EventSink
from dlrover_hpc.checkpoint.saver.segments import (
    COPY_TMP,
    Header,
    copy_name,
    list_segments,
    read_header,
)
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)

CONTEXT = b"dlrover-hpc/replica/v1"
NONCE = 32
MAX_FRAME = 64 << 10
MAX_COPY = 1 << 40
_LEN = struct.Struct(">I")
_SHORT = re.compile(r"^r\d+(?:-[A-Za-z0-9_.]+)?-[ab]$")
_CHUNK = 8 << 20
#: seconds a copy may take beyond its size at 100 MB/s before its peer counts as failed
SLACK_S = 30.0
#: seconds a new connection has to answer the challenge
AUTH_TIMEOUT_S = 30.0
#: connections served at once (every peer node keeps one); more are closed at once
MAX_CONNECTIONS = 256
#: seconds without a byte in the middle of a copy before the receiver gives it up
RECV_IDLE_S = 60.0


#: the most copies of a node's parts (``replica_count``); a round tells each node the replica
#: servers of only the peers these counts can pick, not all nodes' (that grew as nodes^2)
MAX_REPLICAS = 8


def replica_candidates(node_rank: int, nnodes: int, upto: int = MAX_REPLICAS) -> list[int]:
    """Every node rank :func:`replica_peers` picks for ``node_rank`` with a count up to
    ``upto`` (sorted; at most upto*(upto+1)/2 of them)."""
    ranks: set[int] = set()
    for count in range(1, upto + 1):
        ranks.update(replica_peers(node_rank, nnodes, count))
    return sorted(ranks)


def replica_peers(node_rank: int, nnodes: int, count: int) -> list[int]:
    """The node ranks that keep this node's copies (pure).  Ranks follow the switch
    topology (neighbours share a switch), so the peers are spread around the ring rather
    than next door: a switch failure does not take a part and all its copies."""
    want = min(max(count, 0), max(nnodes - 1, 0))
    stride = max(1, nnodes // (want + 1)) if want else 1
    chosen: list[int] = []
    for k in range(1, want + 1):
        peer = (node_rank + k * stride) % nnodes
        while peer == node_rank or peer in chosen:
            peer = (peer + 1) % nnodes
        chosen.append(peer)
    return chosen


def digest(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), CONTEXT + nonce, hashlib.sha256).digest()


def send_json(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_json(sock: socket.socket) -> dict[str, Any] | None:
    head = recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (length,) = _LEN.unpack(head)
    body = recv_exact(sock, length) if length <= MAX_FRAME else None
    if body is None:
        raise CheckpointError(f"bad frame of {length} bytes")
    try:
        message = json.loads(body)  # ValueError: not JSON (the caller answers it)
    except RecursionError:  # "[[[[...": nested too deep for the parser
        raise CheckpointError("a frame nested too deeply") from None
    if not isinstance(message, dict):
        raise CheckpointError("a frame must hold a JSON object")
    return message


class ReplicaServer:
    """Keeps the copies other nodes send of their segments, as ``<prefix>c<name>``.

    `prefix` may be set after `start()` (the agent listens before it knows its job); until
    then every copy is refused.  Each copy is received into a temporary file of its own
    (``<prefix>c<name>.<random>.tmp``, created with O_EXCL) and renamed over the previous copy
    only when whole: two copies of one name in flight never share a file.
    """

    def __init__(
        self,
        *,
        shm_dir: str,
        prefix: str,
        token: str,
        host: str,
        port: int = 0,
        mem_limit_bytes: int | None = None,
        events: EventSink | None = None,
        node_name: str,
    ) -> None:
        self.shm_dir, self.prefix, self._token = shm_dir, prefix, token
        self._bind = (host, port)
        self.mem_limit_bytes, self.events, self.node_name = mem_limit_bytes, events, node_name
        self._listener: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._said_full = -1e9  # when the connection cap was last logged (monotonic)
        self._tmps: set[str] = set()  # copies being received, removed by close()
        self._lock = threading.Lock()
        self._admit = threading.Lock()  # one memory check and reservation at a time
        self._commit = threading.Lock()  # one rename-and-prune at a time
        self._refused: set[str] = set()  # origins told about the memory limit (until it fits)
        self.address: tuple[str, int] = (host, port)

    def start(self) -> None:
        listener = socket.create_server(self._bind, backlog=64)
        self._listener = listener
        self.address = (self._bind[0], listener.getsockname()[1])
        self._accepter = threading.Thread(
            target=self._accept, args=(listener,), name="ckpt-replica-accept", daemon=True
        )
        self._accepter.start()
        logger.info("checkpoint replica_server_listening port=%d", self.address[1])

    def close(self) -> None:
        """Stops accepting, ends every connection (a copy in flight is dropped), joins the
        threads and removes the temporary files."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        if self._accepter is not None:
            self._accepter.join(timeout=5.0)
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in conns.values():
            thread.join(timeout=5.0)
        with self._lock:
            tmps, self._tmps = set(self._tmps), set()
        for tmp in tmps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            thread = threading.Thread(
                target=self._serve, args=(conn, peer), name="ckpt-replica-conn", daemon=True
            )
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns[conn] = thread
            if full:  # a flood of connections: no thread (and no memory) for them
                conn.close()
                now = time.monotonic()
                if now - self._said_full >= 10.0:
                    self._said_full = now
                    logger.warning(
                        "checkpoint replica_refused peer=%s reason=%d connections open "
                        "(said every 10 s)",
                        peer,
                        MAX_CONNECTIONS,
                    )
                continue
            thread.start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            _keepalive(conn)
            conn.settimeout(AUTH_TIMEOUT_S)
            nonce = secrets.token_bytes(NONCE)
            conn.sendall(nonce)
            answer = recv_exact(conn, 32)
            if answer is None or not hmac.compare_digest(answer, digest(self._token, nonce)):
                logger.warning("checkpoint replica_refused peer=%s reason=bad job token", peer)
                return
            while True:
                conn.settimeout(None)  # idle between copies; keepalive finds a dead peer
                try:
                    header = recv_json(conn)
                except (ValueError, CheckpointError) as exc:
                    logger.info(
                        "checkpoint replica_refused peer=%s reason=bad frame (%s)", peer, exc
                    )
                    send_json(conn, {"ok": False, "error": f"bad frame: {exc}"})
                    return
                if header is None or not self._receive(conn, header):
                    return
        except OSError as exc:
            logger.debug("checkpoint replica_conn_closed peer=%s error=%s", peer, exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _check(self, header: dict[str, Any]) -> str | None:
        """Why a copy is refused before its bytes come (None: accepted)."""
        name, size = header.get("name"), header.get("size")
        if not isinstance(name, str) or not _SHORT.fullmatch(name):
            return f"bad segment name {name!r}: expected r<rank>[-<tag>]-<a|b>"
        if not _is_int(size) or not 0 < size <= MAX_COPY:
            return f"bad size {size!r}: expected 1 to {MAX_COPY} bytes"
        if not (_is_int(header.get("step")) and _is_int(header.get("seq"))):
            return f"bad step or seq ({header.get('step')!r}, {header.get('seq')!r})"
        if not self.prefix:
            return "this node has not joined the job yet"
        limit = self.mem_limit_bytes
        if limit is not None and (used := self._usage()) + size > limit:
            origin = _origin(header)
            why = (
                f"no room for a {size / 2**20:.1f} MiB copy from {origin}: this job holds "
                f"{used / 2**20:.1f} MiB of shared memory on {self.node_name} and the limit "
                f"is {limit / 2**20:.1f} MiB (--mem); lower replica_count or raise --mem"
            )
            with self._lock:
                first = origin not in self._refused
                self._refused.add(origin)
            if first:
                logger.warning("checkpoint replica_refused %s (said once per node)", why)
            return why
        return None

    def _usage(self) -> int:
        """Bytes of shared memory this job holds here: own segments, copies, temporaries."""
        total = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.shm_dir):
                if entry.name.startswith(self.prefix):
                    with contextlib.suppress(OSError):
                        total += entry.stat().st_blocks * 512
        return total

    def _reserve(self, final: str, size: int, origin: str) -> tuple[int, str]:
        """A new temporary file beside `final` with `size` bytes reserved; raises
        CheckpointError (the reason to send back) when the space is not there."""
        free = _free_bytes(self.shm_dir)
        if size > free:  # refused before a byte is taken: a tmpfs fills while it tries
            raise CheckpointError(
                f"no room for a {size / 2**20:.1f} MiB copy from {origin} in {self.shm_dir} on "
                f"{self.node_name} ({free / 2**20:.1f} MiB free); lower replica_count or "
                "enlarge the tmpfs"
            )
        tmp = f"{final}.{secrets.token_hex(4)}{COPY_TMP}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with self._lock:
            self._tmps.add(tmp)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            self._discard(tmp)
            free = _free_bytes(self.shm_dir)
            raise CheckpointError(
                f"cannot reserve {size / 2**20:.1f} MiB in {self.shm_dir} on {self.node_name} "
                f"for a copy from {origin} ({os.strerror(exc.errno or errno.EIO)}; "
                f"{free / 2**20:.1f} MiB free); lower replica_count or enlarge the tmpfs"
            ) from exc
        return fd, tmp

    def _discard(self, tmp: str) -> None:
        with contextlib.suppress(OSError), self._lock:
            self._tmps.discard(tmp)
            os.unlink(tmp)

    def _receive(self, conn: socket.socket, header: dict[str, Any]) -> bool:
        """One copy; False when the connection must end (refused or broken)."""
        final = tmp = ""
        with self._admit:  # the check counts the space the copies admitted before reserved
            why = self._check(header)
            if why is None:
                final = os.path.join(self.shm_dir, self.prefix + copy_name(header["name"]))
                try:
                    fd, tmp = self._reserve(final, header["size"], _origin(header))
                except (OSError, CheckpointError) as exc:
                    why = str(exc)
        send_json(conn, {"ok": why is None, **({"error": why} if why else {})})
        if why is not None:
            logger.info("checkpoint replica_refused origin=%s reason=%s", _origin(header), why)
            return False
        try:
            trailer, got = _fill(conn, fd, header["size"])
        except OSError as exc:  # the sender died or went silent: its copy is dropped
            self._discard(tmp)
            logger.debug("checkpoint replica_receive_failed name=%s error=%s", final, exc)
            return False
        finally:
            os.close(fd)
        announced = (header["step"], header["seq"], header["size"])
        if trailer != b"\x01":
            why = "the segment changed while it was sent (a new save began); copy dropped"
        elif got is None or (got.step, got.seq, got.size) != announced:
            why = f"the bytes received are not a complete segment of step {announced[0]}"
        else:
            why = self._commit_copy(tmp, final, _origin(header))
        if why is not None:
            self._discard(tmp)
        send_json(conn, {"ok": why is None, **({"error": why} if why else {})})
        return True

    def _commit_copy(self, tmp: str, final: str, origin: str) -> str | None:
        """Puts a whole copy in place of the previous one; why not (None: done)."""
        with self._commit:
            try:
                os.rename(tmp, final)
            except OSError as exc:
                return f"cannot keep the copy as {final}: {exc.strerror}"
            with self._lock:
                self._tmps.discard(tmp)
                self._refused.discard(origin)
            self._prune(final)
        logger.debug("checkpoint replica_received name=%s from=%s", final, origin)
        return None

    def _prune(self, just_written: str) -> None:
        """Copies older than every step this node's own segments hold are of no use: a
        restore takes a step every part of which survives somewhere, all from one step."""
        own = [read_step(s.path) for s in list_segments(self.shm_dir, self.prefix)]
        steps = [s for s in own if s is not None]
        if not steps:
            return
        oldest = min(steps)
        for copy in list_segments(self.shm_dir, self.prefix, copies=True):
            if copy.path == just_written:
                continue
            step = read_step(copy.path)
            if step is None or step < oldest:
                with contextlib.suppress(OSError):
                    os.unlink(copy.path)
                logger.debug("checkpoint replica_pruned name=%s step=%s", copy.path, step)


def _fill(conn: socket.socket, fd: int, size: int) -> tuple[bytes | None, Header | None]:
    """Receives `size` bytes into the file behind `fd` and the trailer; the header of what
    arrived (None: not a complete segment).  OSError: a disconnect or RECV_IDLE_S silent."""
    conn.settimeout(RECV_IDLE_S)
    with mmap.mmap(fd, size) as mm:
        view = memoryview(mm)
        try:
            got = 0
            while got < size:
                n = conn.recv_into(view[got:], min(_CHUNK, size - got))
                if n == 0:
                    raise OSError("the sender closed in the middle of a copy")
                got += n
        finally:
            view.release()
        trailer = recv_exact(conn, 1)
        if trailer is None:
            raise OSError("the sender closed before the trailer")
        return trailer, read_header(mm)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _origin(header: dict[str, Any]) -> str:
    return str(header.get("node", "?"))[:200]


def _keepalive(conn: socket.socket) -> None:
    """A peer that vanishes without a FIN (a crashed node) is found within ~2 minutes."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, option):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _free_bytes(directory: str) -> int:
    with contextlib.suppress(OSError):
        return (st := os.statvfs(directory)).f_bavail * st.f_frsize
    return 0


def read_step(path: str) -> int | None:
    """The step a complete segment file holds (None: incomplete, torn or gone)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            header = read_header(mm)
    except (OSError, ValueError):
        return None
    return header.step if header is not None else None
