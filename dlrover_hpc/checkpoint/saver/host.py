"""`SaverHost`: the node's checkpoint saver, owned by the agent.

The agent constructs one per node, calls `start()` before spawning workers (and exports
the saver's socket (`environ.SAVER_SOCKET`) to them), `persist_latest()` when a worker died and
before restarting the workers, and `close()` at job end, which finishes in-flight persists and
removes this job's segments on this node.  With a `ReplicaSender`, the agent tells it every
round's replica servers (`set_replica_peers`) and a `replicate` request copies a segment to
the peers `replica_peers` picks, in the background.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Mapping
from typing import Any

from dlrover_hpc.checkpoint.api import CommitCoordinator, EventSink, FaultHook
from dlrover_hpc.checkpoint.env import DEFAULT_SHM_DIR, current_user, segment_prefix, spill_dir
from dlrover_hpc.checkpoint.saver.local_tier import job_tier_exists, remove_job_tier
from dlrover_hpc.checkpoint.saver.persist_at import PersistAt
from dlrover_hpc.checkpoint.saver.persist_queue import Durability, SaverCore
from dlrover_hpc.checkpoint.saver.recovery import persist_latest
from dlrover_hpc.checkpoint.saver.replica_sender import ReplicaSender
from dlrover_hpc.checkpoint.saver.replicas import replica_peers
from dlrover_hpc.checkpoint.saver.save_events import FLUSH_S, SavedEvents
from dlrover_hpc.checkpoint.saver.segments import list_segments, unlink_segments
from dlrover_hpc.checkpoint.saver.tier_writer import TierWriter
from dlrover_hpc.checkpoint.saver.worker_protocol import (
    VERSION,
    Hello,
    Ping,
    Release,
    Replicate,
    Report,
    Saved,
    Wait,
    decode_request,
    recv_frame,
    send_frame,
)
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)


class SaverHost:
    """Listens on a Unix socket for workers' "saved" messages and persists their steps."""

    def __init__(
        self,
        *,
        job_id: str,
        node_name: str,
        socket_path: str,
        commit: CommitCoordinator,
        events: EventSink | None,
        shm_dir: str = DEFAULT_SHM_DIR,
        io_threads: int = 4,
        fault: FaultHook | None = None,
        replicas: ReplicaSender | None = None,
        saved_events: EventSink | None = None,
        local_dir: str = "",
    ) -> None:
        """``saved_events``: where the node's ``checkpoint_saved`` lines go, one per step
        (:mod:`save_events`; the job's events.jsonl); None: each worker writes its own.
        ``local_dir``: the node-local tier each step goes to first (:mod:`tier_writer`)."""
        if not job_id or not node_name:
            raise CheckpointError("SaverHost needs a non-empty job_id and node_name")
        self.job_id = job_id
        self.node_name = node_name
        self.socket_path = socket_path
        self.shm_dir = shm_dir
        self.prefix = segment_prefix(user=current_user(), job_id=job_id, node_name=node_name)
        self.local_dir = local_dir
        tiers = (
            TierWriter(local_dir, job=job_id, events=events, node_name=node_name, fault=fault)
            if local_dir
            else None
        )
        self.core = SaverCore(
            commit=commit,
            events=events,
            node_name=node_name,
            io_threads=io_threads,
            fault=fault,
            tiers=tiers,
        )
        #: the master's --persist-every: each rank's first save at or after a step is persisted
        self.persist_at = PersistAt(self.core, lambda: list_segments(self.shm_dir, self.prefix))
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.replicas = replicas
        #: node rank, node count, "host:port" of the node ranks copies can go to
        self._round_peers: tuple[int, int, dict[int, str]] = (-1, 0, {})
        self._peers: list[tuple[str, int]] = []  # the sender's, for the count last asked
        self._count = -1
        self._ranks: dict[socket.socket, int] = {}  # connected workers (their hello)
        self.saved = (
            SavedEvents(saved_events.emit, expected=lambda: len(set(self._ranks.values())))
            if saved_events is not None
            else None
        )

    # ------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        directory = os.path.dirname(self.socket_path) or "."
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.socket_path).st_mode):
                os.unlink(self.socket_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(self.socket_path)
        finally:
            os.umask(old_umask)
        listener.listen(64)
        self._listener = listener
        self.core.start()
        thread = threading.Thread(target=self._accept_loop, name="ckpt-saver-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        if self.saved is not None:
            flusher = threading.Thread(target=self._flush_loop, name="ckpt-saved", daemon=True)
            flusher.start()
            self._threads.append(flusher)
        logger.info(
            "checkpoint saver_started socket=%s prefix=%s shm_dir=%s",
            self.socket_path,
            self.prefix,
            self.shm_dir,
        )

    def persist_latest(self, timeout_s: float) -> int | None:
        """After a worker died: persists the newest complete in-memory step not yet on
        storage and returns it (None when there is nothing newer to persist)."""
        paths = [s.path for s in list_segments(self.shm_dir, self.prefix)]
        step = persist_latest(self.core, paths, timeout_s)
        logger.info("checkpoint persist_latest step=%s segments=%d", step, len(paths))
        return step

    def persist_step(self, step: int) -> list[int]:
        """The master asks every node to persist the first save at or after ``step`` (its
        ``--persist-every``); returns the ranks whose save of it was submitted at once."""
        return self.persist_at.arm(step)

    def set_replica_peers(self, node_rank: int, nnodes: int, peers: Mapping[int, str]) -> None:
        """A new round: this node's rank, the round's node count, and the replica servers of
        the node ranks its copies can go to."""
        with self._lock:
            self._round_peers, self._count = (node_rank, nnodes, dict(peers)), -1

    def _replicate(self, path: str, step: int, count: int) -> None:
        sender = self.replicas
        if sender is None or count <= 0:
            return
        with self._lock:
            node_rank, nnodes, peers = self._round_peers
            if count != self._count:
                chosen = [peers.get(i, "") for i in replica_peers(node_rank, nnodes, count)]
                self._peers = [_address(p) for p in chosen if p]
                self._count = count
                sender.set_peers(self._peers)
                if len(self._peers) < count:
                    logger.warning(
                        "checkpoint replicas_short wanted=%d peers=%d: the round has fewer "
                        "nodes with a replica server",
                        count,
                        len(self._peers),
                    )
        sender.offer(path, step)

    def wait_idle(self, timeout_s: float) -> bool:
        return self.core.wait_idle(timeout_s)

    def durability(self) -> list[Durability]:
        return self.core.durability()

    def ckpt_dirs(self) -> list[str]:
        """Where this node's steps were persisted to (a node health check's storage check)."""
        return self.core.ckpt_dirs()

    def segments(self) -> list[str]:
        return [s.path for s in list_segments(self.shm_dir, self.prefix)]

    def close(
        self,
        remove_segments: bool = True,
        *,
        timeout_s: float = 600.0,
        remove_local_tier: bool | None = None,
    ) -> None:
        """Stops listening, finishes in-flight persists, then unlinks this job's segments and
        removes its local tier on this node (``remove_local_tier``; default: with the
        segments)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, self._listener = self._listener, None
            conns = list(self._conns)
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5.0)
        if self.saved is not None:
            self.saved.flush(everything=True)
        if self.replicas is not None:
            self.replicas.close()
        if not self.core.close(timeout_s=timeout_s):
            logger.warning("checkpoint saver_close_timeout: persists still running were dropped")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        if remove_segments:
            removed = unlink_segments(self.shm_dir, self.prefix)
            logger.info("checkpoint segments_removed count=%d prefix=%s", len(removed), self.prefix)
        remove_tier = remove_segments if remove_local_tier is None else remove_local_tier
        if remove_tier and self.local_dir:  # the job's end: its local tier goes
            remove_job_tier(self.local_dir, self.job_id, self.node_name)

    def has_local_tier(self) -> bool:
        """Whether this job has steps in the node-local tier (kept, like segments, for a
        requeued run on this node)."""
        return job_tier_exists(self.local_dir, self.job_id, self.node_name)

    # ------------------------------------------------------------------------ serving
    def _flush_loop(self) -> None:
        """Writes the steps some rank never reported (it died before its save)."""
        assert self.saved is not None
        while not self._closed:
            time.sleep(FLUSH_S / 5)
            self.saved.flush()

    def _accept_loop(self) -> None:
        while True:
            listener = self._listener
            if listener is None:
                return
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            thread = threading.Thread(
                target=self._serve, args=(conn,), name="ckpt-saver-conn", daemon=True
            )
            thread.start()
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                try:
                    frame = recv_frame(conn)
                except CheckpointError as exc:  # a bad frame: one line, then close
                    logger.warning("checkpoint saver_conn_refused error=%s", exc)
                    return
                except OSError as exc:
                    logger.debug("checkpoint saver_conn_closed error=%s", exc)
                    return
                if frame is None:
                    return
                reply = self._handle(frame)
                if frame.get("type") == "hello" and reply.get("ok"):
                    with self._lock, contextlib.suppress(TypeError, ValueError, KeyError):
                        self._ranks[conn] = int(frame["rank"])  # its saves are awaited
                try:
                    send_frame(conn, reply)
                except OSError:
                    return
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._ranks.pop(conn, None)
            conn.close()

    def _handle(self, frame: dict[str, Any]) -> dict[str, Any]:
        request_id = frame.get("id", 0)
        try:
            request_id, message, timeout_s = decode_request(frame)
            result = self._dispatch(message, timeout_s)
        except (CheckpointError, OSError, ValueError, TypeError) as exc:
            # a request that cannot be served (no such segment, a bad field): answered
            logger.info("checkpoint saver_request_refused type=%s error=%s", frame.get("type"), exc)
            return {"v": VERSION, "id": request_id, "ok": False, "error": str(exc)}
        except Exception as exc:  # request boundary: answer, log once
            logger.exception("checkpoint saver_request_failed type=%s", frame.get("type"))
            return {"v": VERSION, "id": request_id, "ok": False, "error": repr(exc)}
        return {"v": VERSION, "id": request_id, "ok": True, **result}

    def _own_segment(self, name: str, *, spilled: bool = False) -> str:
        """The path of a segment a worker names; refused unless it is this job's on this node.
        ``spilled``: a save that shared memory had no room for, in the spill directory."""
        if "/" in name or not name.startswith(self.prefix):
            raise CheckpointError(
                f"segment {name!r} does not belong to job {self.job_id} on {self.node_name}"
            )
        return os.path.join(spill_dir() if spilled else self.shm_dir, name)

    def _dispatch(self, message: Any, timeout_s: float) -> dict[str, Any]:
        if isinstance(message, Hello):
            logger.info("checkpoint worker_hello rank=%d pid=%d", message.rank, message.pid)
            return {
                "job_id": self.job_id,
                "node_name": self.node_name,
                "prefix": self.prefix,
                "shm_dir": self.shm_dir,
            }
        if isinstance(message, Saved):
            path = self._own_segment(message.segment, spilled=bool(message.spilled))
            self.core.submit(path, step=int(message.step))
            return {}
        if isinstance(message, Release):
            return {"released": self.core.release(self._own_segment(message.segment))}
        if isinstance(message, Replicate):
            path = self._own_segment(message.segment)
            self._replicate(path, int(message.step), int(message.count))
            return {}
        if isinstance(message, Wait):
            done = self.core.wait_committed(
                message.ckpt_dir,
                int(message.step),
                timeout_s,
                rank=int(message.rank),
                token=int(message.token),
            )
            return {"committed": done}
        if isinstance(message, Report):
            try:  # before the answer: the worker's buffer holds the step until then
                self.persist_at.saved(int(message.rank), int(message.step))
            except (CheckpointError, OSError, ValueError) as exc:
                logger.warning("checkpoint persist_at_failed step=%s error=%s", message.step, exc)
            if self.saved is None:
                raise CheckpointError("this saver writes no checkpoint_saved: write your own")
            self.saved.report(
                rank=message.rank,
                step=message.step,
                storage=message.storage,
                blocking_s=message.blocking_s,
                total_s=message.total_s,
                local_world=message.local_world,
            )
            return {}
        if isinstance(message, Ping):
            return {}
        raise CheckpointError(f"unhandled request {type(message).__name__}")


def _address(peer: str) -> tuple[str, int]:
    host, _, port = peer.rpartition(":")
    return host, int(port)
