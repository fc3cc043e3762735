"""The master's journal (resume after a master restart) and the job's events.jsonl."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from dlrover_hpc.events import EventName

log = logging.getLogger(__name__)


def _line(obj: dict[str, Any]) -> bytes:
    """``obj`` as one JSON line; orjson (a sixth of json's time: a line per agent's join, 16,384
    in a rendezvous), json for what orjson refuses (integers past 64 bits)."""
    try:
        return orjson.dumps(obj, default=str, option=_ORJSON_LINE)
    except (TypeError, orjson.JSONEncodeError):
        return (json.dumps(obj, separators=(",", ":"), default=str) + "\n").encode()


_ORJSON_LINE = orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE


def _append_line(path: Path, obj: dict[str, Any]) -> int:
    """One write(2) per line with O_APPEND, so concurrent writers never interleave a line;
    returns its bytes."""
    data = _line(obj)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return len(data)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True, slots=True)
class TornLine:
    """A last line cut mid-write, found at a master's start."""

    path: Path
    line: int  # its number, from 1
    nbytes: int
    text: str  # its first bytes, as Python writes them


_CHUNK = 1 << 20


def seal_torn_line(path: Path) -> TornLine | None:
    """Ends a last line that was cut mid-write (its writer's node lost power, the disk filled)
    with a newline, so that the next record starts a line of its own instead of being glued to
    the torn one and lost with it; the torn line stays, as evidence, and readers skip it.

    A newline appended (never a truncation) is safe while other processes append their own
    lines: the workers write checkpoint events to ``events.jsonl`` beside a new master."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return None
        newlines, offset, start = 0, 0, 0  # start: where the last line begins
        while offset < size:
            chunk = os.pread(fd, min(_CHUNK, size - offset), offset)
            if not chunk:
                break
            newlines += chunk.count(b"\n")
            last = chunk.rfind(b"\n")
            if last >= 0:
                start = offset + last + 1
            offset += len(chunk)
        head = os.pread(fd, min(80, size - start), start)
        os.write(fd, b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    return TornLine(path=path, line=newlines + 1, nbytes=size - start, text=repr(head))


class EventLog:
    """``events.jsonl``: one JSON object per line with ``time``, ``event`` and fields."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        #: kept open (O_APPEND: a line is still one write(2), never interleaved with the
        #: workers'): an open and a close per line were a tenth of a 16,384-agent rendezvous,
        #: one node_joined each
        self._fd: int | None = None

    def emit(self, event: EventName, **fields: Any) -> None:
        data = _line({"time": time.time(), "event": event, **fields})
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(self._fd, data)
            except OSError:  # a full or failing disk: opened again for the next line
                self.close()
                raise

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


#: The journal is compacted once it holds this much more than twice its last snapshot (a line
#: per node's checkpoint part and a members row per node in every round: at 4,096 nodes, a
#: checkpoint every 5 minutes and a fault every 20, about 7 MB an hour otherwise).
COMPACT_BYTES = 4 << 20


class Journal:
    """Append-only record of what a restarted master must not forget, compacted now and then
    into one snapshot record of the same state (:meth:`compact`)."""

    def __init__(self, path: str | os.PathLike[str], *, compact_bytes: int = COMPACT_BYTES) -> None:
        self.path = Path(path)
        self.compact_bytes = compact_bytes
        #: the checkpoint parts a snapshot keeps (the owner's counter: parts of steps not
        #: committed yet); None: all of them
        self.keep_part: Callable[[Sequence[Any]], bool] | None = None
        self._snapshot_bytes = 0
        try:
            self._size = self.path.stat().st_size
        except FileNotFoundError:
            self._size = 0

    def append(self, *, sync: bool = True, **fields: Any) -> None:
        """``sync``: durable before returning (a checkpoint part need not be: a part lost with
        the master's node only delays the commit to the next checkpoint)."""
        self._size += _append_line(self.path, {"time": time.time(), **fields})
        if self._size > 2 * self._snapshot_bytes + self.compact_bytes:
            self.compact()  # durable too: the snapshot is fsynced before it replaces the file
            return
        if not sync:  # in the page cache: survives the master process, not its node
            return
        # The journal decides what a restarted master does: make each record durable.
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def compact(self) -> bool:
        """Replace the journal with one record of what :meth:`load` reads from it, less the
        checkpoint parts :attr:`keep_part` drops: written beside it, fsynced, renamed over it
        (a crash leaves the old journal or the new one, never a mix).  A journal that grew
        meanwhile (another master appended: it took over) is left as it is (False)."""
        try:
            before = self.path.stat().st_size
        except FileNotFoundError:
            return False
        state = self.load()
        if self.keep_part is not None:
            state["ckpt_parts"] = [p for p in state["ckpt_parts"] if self.keep_part(p)]
        state["time"] = time.time()
        data = (json.dumps(state, separators=(",", ":"), default=str) + "\n").encode()
        tmp = self.path.with_name(self.path.name + ".compacting")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if self.path.stat().st_size != before:
            tmp.unlink()
            log.warning("journal not compacted file=%s: it grew meanwhile", self.path)
            return False
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        log.info("journal compacted file=%s bytes=%d->%d", self.path, before, len(data))
        self._size = self._snapshot_bytes = len(data)
        return True

    def load(self) -> dict[str, Any]:
        """The merged state (later records win); a torn last line is skipped.

        ``ckpt_part`` records accumulate under ``ckpt_parts`` from the newest ``round`` record
        on (a new round is a new generation of workers: older parts never complete), and
        ``time`` is the newest record's."""
        state: dict[str, Any] = {"ckpt_parts": []}
        try:  # a power loss can leave any bytes (zeros) where a line was being written
            lines = self.path.read_bytes().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return state
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if line.strip():
                    log.warning(
                        "journal line skipped file=%s line=%d (torn write)", self.path, number
                    )
                continue
            if not isinstance(record, dict):
                log.warning(
                    "journal line skipped file=%s line=%d (not an object)", self.path, number
                )
                continue
            if "ckpt_part" in record:
                state["ckpt_parts"].append(record["ckpt_part"])
                state["time"] = record.get("time", 0.0)
                continue
            if "round" in record:
                state["ckpt_parts"] = []
            state.update(record)
        return state
