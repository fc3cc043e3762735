"""Event sinks: JSON lines appended to the job's events.jsonl (docs/design/architecture.md,
event log)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from dlrover_hpc.events import EventName

logger = logging.getLogger(__name__)


class JsonlEventSink:
    """Appends one JSON object per event to `path`: one `write()` of one line, with O_APPEND.

    Several processes can share the file: O_APPEND makes each line land whole.  `defaults`
    (e.g. rank and node) are added to every event unless the event sets them itself.
    """

    def __init__(self, path: str, **defaults: Any) -> None:
        self._path = path
        self._defaults = defaults
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = -1

    @property
    def path(self) -> str:
        return self._path

    def emit(self, event: EventName, **fields: Any) -> None:
        record: dict[str, Any] = {"time": time.time(), "event": event}
        record.update(self._defaults)
        record.update(fields)
        line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
        try:
            with self._lock:
                fd = self._open()
                os.write(fd, line)
        except OSError as exc:  # an event log must never break training
            logger.warning("events write_failed path=%s error=%s", self._path, exc)

    def _open(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._pid = os.getpid()
        return self._fd

    def close(self) -> None:
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None


class ListEventSink:
    """Keeps events in memory; for tests and for callers that forward them elsewhere."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def emit(self, event: EventName, **fields: Any) -> None:
        with self._lock:
            self.events.append({"time": time.time(), "event": event, **fields})

    def named(self, event: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e["event"] == event]
