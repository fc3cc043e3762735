"""The master's journal (resume after a master restart) and the job's events.jsonl."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from dlrover_hpc.events import EventName

log = logging.getLogger(__name__)


def _append_line(path: Path, obj: dict[str, Any]) -> None:
    """One write(2) per line with O_APPEND, so concurrent writers never interleave a line."""
    data = (json.dumps(obj, separators=(",", ":"), default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


class EventLog:
    """``events.jsonl``: one JSON object per line with ``time``, ``event`` and fields."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def emit(self, event: EventName, **fields: Any) -> None:
        with self._lock:
            _append_line(self.path, {"time": time.time(), "event": event, **fields})


class Journal:
    """Append-only record of what a restarted master must not forget."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def append(self, *, sync: bool = True, **fields: Any) -> None:
        """``sync``: durable before returning (a checkpoint part need not be: a part lost with
        the master's node only delays the commit to the next checkpoint)."""
        _append_line(self.path, {"time": time.time(), **fields})
        if not sync:  # in the page cache: survives the master process, not its node
            return
        # The journal decides what a restarted master does: make each record durable.
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self) -> dict[str, Any]:
        """The merged state (later records win); a torn last line is skipped.

        ``ckpt_part`` records accumulate under ``ckpt_parts`` from the newest ``round`` record
        on (a new round is a new generation of workers: older parts never complete), and
        ``time`` is the newest record's."""
        state: dict[str, Any] = {"ckpt_parts": []}
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return state
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                log.warning("journal line skipped file=%s line=%d (torn write)", self.path, number)
                continue
            if "ckpt_part" in record:
                state["ckpt_parts"].append(record["ckpt_part"])
                state["time"] = record.get("time", 0.0)
                continue
            if "round" in record:
                state["ckpt_parts"] = []
            state.update(record)
        return state
