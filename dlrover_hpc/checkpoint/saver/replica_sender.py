"""The sending side of cross-node memory replicas (see :mod:`replicas` for the protocol).

One background thread copies each segment the node's ranks finished to every peer; offers
of one segment coalesce (only its newest step is pending), so a slow peer costs copies of
intermediate steps, never training time.  A failed peer is warned about once until it
works again, and never holds up the copies to the others for longer than its timeout.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from dlrover_hpc.checkpoint.api import EventSink
from dlrover_hpc.checkpoint.saver.replicas import (
    NONCE,
    SLACK_S,
    digest,
    recv_exact,
    recv_json,
    send_json,
)
from dlrover_hpc.checkpoint.saver.segments import State, read_header
from dlrover_hpc.errors import CheckpointError
from dlrover_hpc.events import EventName

logger = logging.getLogger(__name__)

Peer = tuple[str, int]


class ReplicaSender:
    def __init__(
        self,
        *,
        shm_dir: str,
        prefix: str,
        token: str,
        node_name: str,
        events: EventSink | None = None,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.shm_dir, self.prefix, self._token = shm_dir, prefix, token
        self.node_name, self.events, self.connect_timeout_s = node_name, events, connect_timeout_s
        self._peers: list[Peer] = []
        self._conns: dict[Peer, socket.socket] = {}
        self._failing: set[Peer] = set()
        self._pending: dict[str, int] = {}  # segment file name -> newest step offered
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._stats = {"copies": 0, "bytes": 0, "seconds": 0.0, "torn": 0, "failures": 0}
        self._thread = threading.Thread(target=self._run, name="ckpt-replica-send", daemon=True)
        self._thread.start()

    def set_peers(self, peers: Sequence[Peer]) -> None:
        """The peers that get every copy from now on (a new round may change them)."""
        with self._cond:
            self._peers = list(peers)
            gone = [p for p in self._conns if p not in self._peers]
            stale = [self._conns.pop(p) for p in gone]
        for conn in stale:  # the sending thread only uses connections it looks up anew
            with contextlib.suppress(OSError):
                conn.close()

    def offer(self, name: str, step: int) -> None:
        """Segment `name` (a file name or path in shm_dir) now holds `step`; never blocks."""
        with self._cond:
            key = os.path.basename(name)
            self._pending[key] = max(step, self._pending.get(key, step))
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return dict(self._stats)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30.0)
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                conn.close()
        self._conns.clear()

    # ------------------------------------------------------------------ the sending thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                name = next(iter(self._pending))
                step = self._pending.pop(name)
                peers = list(self._peers)
                self._busy = True
            try:
                if peers:
                    self._copy(name, step, peers)
            except Exception:  # thread boundary: a copy is best effort
                logger.exception("checkpoint replica_copy_failed name=%s", name)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _copy(self, name: str, step: int, peers: list[Peer]) -> None:
        path = os.path.join(self.shm_dir, name)
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                header = read_header(mm)
                if header is None or header.step < step:
                    return  # being rewritten: its writer offers the newer step
                t0 = time.monotonic()
                sent = []
                for peer in peers:
                    now = read_header(mm)
                    if now is None or now.seq != header.seq or not _complete(mm):
                        break  # a new save began: the rest would get a torn copy too
                    if self._send(peer, name, header, mm):
                        sent.append(peer)
                seconds = time.monotonic() - t0
        except (FileNotFoundError, ValueError):
            return  # removed (job end, an earlier world's), or empty
        if not sent:
            return
        nbytes = header.size * len(sent)
        with self._cond:
            self._stats["copies"] += 1
            self._stats["bytes"] += nbytes
            self._stats["seconds"] += seconds
        logger.debug("checkpoint replicated name=%s step=%d peers=%s", name, header.step, sent)
        if self.events is not None:
            self.events.emit(
                EventName.CHECKPOINT_REPLICATED,
                node=self.node_name,
                step=header.step,
                name=name[len(self.prefix) :],
                peers=[f"{h}:{p}" for h, p in sent],
                bytes=nbytes,
                seconds=round(seconds, 6),
            )

    def _send(self, peer: Peer, name: str, header: Any, mm: mmap.mmap) -> bool:
        size = header.size
        try:
            conn = self._connection(peer)
            conn.settimeout(SLACK_S + size / 100e6)
            short = name[len(self.prefix) :]
            frame = {"name": short, "step": header.step, "seq": header.seq, "size": size}
            send_json(conn, {**frame, "node": self.node_name})
            go = recv_json(conn)
            if go is None or not go.get("ok"):
                raise CheckpointError(str((go or {}).get("error", "the peer closed")))
            with memoryview(mm) as view:
                conn.sendall(view[:size])
            after = read_header(mm)
            intact = after is not None and after.seq == header.seq and _complete(mm)
            conn.sendall(b"\x01" if intact else b"\x00")
            done = recv_json(conn)
            if not intact:
                with self._cond:
                    self._stats["torn"] += 1
                return False
            if done is None or not done.get("ok"):
                raise CheckpointError(str((done or {}).get("error", "the peer closed")))
        except (OSError, CheckpointError, ValueError) as exc:
            self._drop(peer)
            with self._cond:
                self._stats["failures"] += 1
            if peer not in self._failing:
                self._failing.add(peer)
                logger.warning(
                    "checkpoint replica_peer_failed peer=%s:%d error=%s: its copies stop "
                    "until it works again (said once)",
                    *peer,
                    exc,
                )
            return False
        if peer in self._failing:
            self._failing.discard(peer)
            logger.info("checkpoint replica_peer_back peer=%s:%d", *peer)
        return True

    def _connection(self, peer: Peer) -> socket.socket:
        with self._cond:
            conn = self._conns.get(peer)
        if conn is not None:
            return conn
        conn = socket.create_connection(peer, timeout=self.connect_timeout_s)
        try:
            nonce = recv_exact(conn, NONCE)
            if nonce is None:
                raise CheckpointError("the peer closed before its challenge")
            conn.sendall(digest(self._token, nonce))
        except BaseException:
            conn.close()
            raise
        with self._cond:
            if peer in self._peers:
                self._conns[peer] = conn
        return conn

    def _drop(self, peer: Peer) -> None:
        with self._cond:
            conn = self._conns.pop(peer, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()


def _complete(mm: mmap.mmap) -> bool:
    """The segment's state is still COMPLETE (a save begun since sets WRITING first)."""
    return int.from_bytes(mm[12:16], "little") == State.COMPLETE
