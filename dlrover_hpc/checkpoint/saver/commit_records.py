"""Commit records, the tracker and retention of one checkpoint directory.

A step is committed when every part is durable.  The saver that completes the set (told so
by a `CommitCoordinator`, see `commits`) writes a commit record
`.dlrover-hpc/commits/step-<N>.json` and then replaces `dlrover_latest.txt`, both atomically.
Loaders trust commit records, not the tracker: the tracker is kept for DLRover's tools and for
people.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import posixpath
import re

from dlrover_hpc.checkpoint.api import META_DIR, TRACKER_FILE, FaultHook
from dlrover_hpc.checkpoint.saver.storage import Storage, _no_fault
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)

_RECORD = re.compile(r"^step-(\d+)\.json$")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CommitRecord:
    step: int
    path: str
    kind: str
    parts: int
    token: int
    time: float

    def to_json(self) -> bytes:
        return json.dumps({"format": 1, **dataclasses.asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> CommitRecord:
        data = json.loads(raw)
        return cls(
            step=int(data["step"]),
            path=str(data["path"]),
            kind=str(data["kind"]),
            parts=int(data["parts"]),
            token=int(data["token"]),
            time=float(data["time"]),
        )


class CheckpointDir:
    """The bookkeeping of one checkpoint directory."""

    def __init__(self, url: str, storage: Storage) -> None:
        self.storage = storage
        self.root = storage.path(url).rstrip("/") or "/"
        self.tracker = f"{self.root}/{TRACKER_FILE}"
        self.records_dir = f"{self.root}/{META_DIR}/commits"

    def record_path(self, step: int) -> str:
        return f"{self.records_dir}/step-{step:012d}.json"

    def records(self) -> list[CommitRecord]:
        """Commit records, newest step first; unreadable ones are skipped with a warning."""
        out = []
        for name in self.storage.listdir(self.records_dir):
            if not _RECORD.match(name):
                continue
            raw = self.storage.read_bytes(f"{self.records_dir}/{name}")
            try:
                out.append(CommitRecord.from_json(raw or b""))
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("checkpoint bad_commit_record file=%s error=%s", name, exc)
        return sorted(out, key=lambda r: r.step, reverse=True)

    def newest_step(self) -> int | None:
        listing = self.storage.listdir(self.records_dir)
        return max((int(m.group(1)) for n in listing if (m := _RECORD.match(n))), default=None)

    def record(self, step: int) -> CommitRecord | None:
        raw = self.storage.read_bytes(self.record_path(step))
        if raw is None:
            return None
        try:
            return CommitRecord.from_json(raw)
        except (ValueError, KeyError, TypeError):
            return None

    def tracker_step(self) -> int | None:
        raw = self.storage.read_bytes(self.tracker)
        try:
            return int(raw.strip()) if raw else None
        except ValueError:
            return None

    def commit(
        self, record: CommitRecord, *, keep_last: int | None, fault: FaultHook = _no_fault
    ) -> None:
        fault("commit:start")
        self.storage.write_bytes(self.record_path(record.step), record.to_json(), fault=fault)
        fault("commit:recorded")
        current = self.tracker_step()
        if current is None or record.step >= current:
            self.storage.write_bytes(self.tracker, f"{record.step}\n".encode(), fault=fault)
        fault("commit:tracked")
        if keep_last:
            self.apply_retention(keep_last, fault=fault)
        step_path = self.storage.path(record.path)
        for directory in {self.root, self.records_dir, posixpath.dirname(step_path), step_path}:
            self.storage.sweep_tmp(directory)

    def uncommit(self, step: int) -> None:
        """Drops a commit record whose files are about to be replaced by another save."""
        self.storage.remove(self.record_path(step))

    def apply_retention(self, keep_last: int, *, fault: FaultHook = _no_fault) -> list[int]:
        """Deletes all but the newest `keep_last` committed steps: record first, then data,
        so a crash never leaves a record that points at deleted data."""
        if keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last} must be at least 1")
        records = self.records()
        kept = {self.storage.path(r.path) for r in records[:keep_last]}
        removed = []
        for old in records[keep_last:]:
            self.storage.remove(self.record_path(old.step))
            fault("retention:record_removed")
            data = self.storage.path(old.path)
            if data not in kept and data.rstrip("/") != self.root:
                self.storage.remove(data)
            fault("retention:data_removed")
            removed.append(old.step)
        if removed:
            logger.info("checkpoint retention removed_steps=%s keep_last=%d", removed, keep_last)
        return removed
