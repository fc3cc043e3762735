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

Wire (TCP, one connection per peer, kept open): the server sends a 32-byte nonce, the client
answers HMAC-SHA256(job token, CONTEXT + nonce).  Per copy: a JSON frame ``{name, step, seq,
size, node}`` -> ``{ok}``, then ``size`` raw bytes and one trailer byte (1: intact, 0: torn)
-> ``{ok}``.  JSON frames are a 4-byte big-endian length and UTF-8 JSON.
"""

from __future__ import annotations

import contextlib
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
from typing import Any

from dlrover_hpc.checkpoint.api import EventSink
from dlrover_hpc.checkpoint.saver.segments import COPY_TMP, copy_name, list_segments, read_header
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
    message = json.loads(body)
    if not isinstance(message, dict):
        raise CheckpointError("a frame must hold a JSON object")
    return message


class ReplicaServer:
    """Keeps the copies other nodes send of their segments, as ``<prefix>c<name>``."""

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
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._refused: set[str] = set()  # origins told about the memory limit (once)
        self.address: tuple[str, int] = (host, port)

    def start(self) -> None:
        listener = socket.create_server(self._bind, backlog=64)
        self._listener = listener
        self.address = (self._bind[0], listener.getsockname()[1])
        thread = threading.Thread(target=self._accept, name="ckpt-replica-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        logger.info("checkpoint replica_server_listening port=%d", self.address[1])

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5.0)

    def _accept(self) -> None:
        while (listener := self._listener) is not None:
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            thread = threading.Thread(
                target=self._serve, args=(conn, peer), name="ckpt-replica-conn", daemon=True
            )
            thread.start()
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            conn.settimeout(30.0)
            nonce = secrets.token_bytes(NONCE)
            conn.sendall(nonce)
            answer = recv_exact(conn, 32)
            if answer is None or not hmac.compare_digest(answer, digest(self._token, nonce)):
                logger.warning("checkpoint replica_refused peer=%s reason=bad job token", peer)
                return
            conn.settimeout(None)
            while (header := recv_json(conn)) is not None:
                if not self._receive(conn, header):
                    return
        except (OSError, ValueError, CheckpointError) as exc:
            logger.debug("checkpoint replica_conn_closed peer=%s error=%s", peer, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _check(self, header: dict[str, Any]) -> str | None:
        """Why a copy is refused before its bytes come (None: accepted)."""
        name, size, step = header.get("name"), header.get("size"), header.get("step")
        if not isinstance(name, str) or not _SHORT.match(name):
            return f"bad segment name {name!r}"
        if not isinstance(size, int) or not 0 < size <= MAX_COPY or not isinstance(step, int):
            return f"bad size or step ({size!r}, {step!r})"
        if not self.prefix:
            return "this node has not joined the job yet"
        limit = self.mem_limit_bytes
        if limit is not None:
            used = self._usage()
            if used + size > limit:
                origin = str(header.get("node", "?"))
                why = (
                    f"no room for a {size / 2**20:.1f} MiB copy from {origin}: this job holds "
                    f"{used / 2**20:.1f} MiB of shared memory on {self.node_name} and the limit "
                    f"is {limit / 2**20:.1f} MiB (--mem); lower replica_count or raise --mem"
                )
                if origin not in self._refused:
                    self._refused.add(origin)
                    logger.warning("checkpoint replica_refused %s", why)
                return why
        return None

    def _usage(self) -> int:
        total = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.shm_dir):
                if entry.name.startswith(self.prefix):
                    with contextlib.suppress(OSError):
                        total += entry.stat().st_blocks * 512
        return total

    def _receive(self, conn: socket.socket, header: dict[str, Any]) -> bool:
        """One copy; False when the connection must end (refused or broken)."""
        why = self._check(header)
        send_json(conn, {"ok": why is None, **({"error": why} if why else {})})
        if why is not None:
            return False
        size, step, seq = int(header["size"]), int(header["step"]), header.get("seq")
        final = os.path.join(self.shm_dir, self.prefix + copy_name(str(header["name"])))
        tmp = final + COPY_TMP
        kept = False
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
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
                    intact = read_header(mm)
            finally:
                os.close(fd)
            if (
                trailer == b"\x01"
                and intact is not None
                and (intact.step, intact.seq)
                == (
                    step,
                    seq,
                )
            ):
                os.rename(tmp, final)
                kept = True
            if trailer is None:
                raise OSError("the sender closed before the trailer")
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            logger.debug("checkpoint replica_receive_failed name=%s error=%s", final, exc)
            return False
        finally:
            if not kept:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        if kept:
            self._prune(final)
        send_json(conn, {"ok": kept, **({} if kept else {"error": "torn copy dropped"})})
        return True

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


def read_step(path: str) -> int | None:
    """The step a complete segment file holds (None: incomplete, torn or gone)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            header = read_header(mm)
    except (OSError, ValueError):
        return None
    return header.step if header is not None else None
