"""Watching the persist thread for storage that stopped answering: ``persist_stalled``.

A persist makes progress at named points (a chunk written, a file fsynced, renamed, a commit
record written): the saver's fault hook passes through :meth:`StallWatch.progress`.  When the
persist in flight has made none for :data:`STALL_S`, storage is stalled (a hung NFS server, a
cut link, a full disk that blocks): the log and the event say so once (``ongoing: true``, the
seconds so far), and again when the persist moves on, fails or is abandoned (``ongoing: false``,
the seconds it lasted).  Training never waits for it: the saver pins only the buffer it
persists, so every save still has the other one.
"""

from __future__ import annotations

import logging
import threading
import time

from dlrover_hpc.checkpoint.api import EventSink
from dlrover_hpc.events import EventName

logger = logging.getLogger(__name__)

#: seconds without progress after which a persist in flight is reported as stalled
STALL_S = 5.0
#: how often the watch looks
LOOK_S = 1.0


class StallWatch:
    """One per saver: told when a persist starts, progresses and ends; reports stalls."""

    def __init__(self, *, events: EventSink | None, node: str, stall_s: float = STALL_S) -> None:
        self._events = events
        self._node = node
        self.stall_s = stall_s
        self._lock = threading.Condition()
        self._step: int | None = None  # the persist in flight
        self._path = ""
        self._last = 0.0  # monotonic time of its last progress
        self._stalled_at: float | None = None  # wall time the stall began, once reported
        self._stalled_mono = 0.0
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckpt-stalls", daemon=True)
                self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)
        self.finished()

    # ------------------------------------------------------------------------ the persist
    def started(self, step: int, path: str) -> None:
        with self._lock:
            self._step, self._path, self._last = step, path, time.monotonic()
            self._lock.notify_all()

    def progress(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._last = now
            if self._stalled_at is None:
                return
            fields = self._resumed(now, "it answered again")
        self._emit(fields)

    def finished(self) -> None:
        with self._lock:
            fields = None
            if self._stalled_at is not None:
                fields = self._resumed(time.monotonic(), "the persist ended")
            self._step = None
        if fields is not None:
            self._emit(fields)

    # ------------------------------------------------------------------------ watching
    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait(LOOK_S)
                if self._stopping:
                    return
                if self._step is None or self._stalled_at is not None:
                    continue
                quiet = time.monotonic() - self._last
                if quiet < self.stall_s:
                    continue
                fields = self._stalled(quiet)
            self._emit(fields)

    def _stalled(self, quiet: float) -> dict[str, object]:
        self._stalled_at, self._stalled_mono = time.time() - quiet, self._last
        logger.warning(
            "checkpoint persist_stalled step=%s path=%s seconds=%.1f: storage has not answered "
            "for %.0f s; training goes on (saves use the other shared-memory buffer) and the "
            "newest step is persisted when storage answers",
            self._step,
            self._path,
            quiet,
            quiet,
        )
        return self._fields(seconds=quiet, ongoing=True)

    def _resumed(self, now: float, why: str) -> dict[str, object]:
        seconds = now - self._stalled_mono
        logger.warning(
            "checkpoint persist_stalled step=%s path=%s seconds=%.1f ended: %s",
            self._step,
            self._path,
            seconds,
            why,
        )
        fields = self._fields(seconds=seconds, ongoing=False)
        self._stalled_at = None
        return fields

    def _fields(self, *, seconds: float, ongoing: bool) -> dict[str, object]:
        return {
            "step": self._step,
            "path": self._path,
            "seconds": round(seconds, 3),
            "ongoing": ongoing,
            "since": None if self._stalled_at is None else round(self._stalled_at, 3),
            "node": self._node,
        }

    def _emit(self, fields: dict[str, object]) -> None:
        """Outside the lock: an event sink that blocks never holds up the persist."""
        if self._events is None:
            return
        try:
            self._events.emit(EventName.PERSIST_STALLED, **fields)
        except Exception:  # an event sink on a hung file system must not end the watch
            logger.exception("checkpoint persist_stalled event could not be written")
