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
        self,
        record: CommitRecord,
        *,
        keep_last: int | None,
        keep_interval: int | None = None,
        fault: FaultHook = _no_fault,
    ) -> None:
        fault("commit:start")
        self.storage.write_bytes(self.record_path(record.step), record.to_json(), fault=fault)
        fault("commit:recorded")
        current = self.tracker_step()
        if current is None or record.step >= current:
            self.storage.write_bytes(self.tracker, f"{record.step}\n".encode(), fault=fault)
        fault("commit:tracked")
        if keep_last or keep_interval:
            self.apply_retention(keep_last, keep_interval=keep_interval, fault=fault)
        step_path = self.storage.path(record.path)
        for directory in {self.root, self.records_dir, posixpath.dirname(step_path), step_path}:
            self.storage.sweep_tmp(directory)

    def uncommit(self, step: int) -> None:
        """Drops a commit record whose files are about to be replaced by another save."""
        self.storage.remove(self.record_path(step))

    def apply_retention(
        self,
        keep_last: int | None,
        *,
        keep_interval: int | None = None,
        fault: FaultHook = _no_fault,
    ) -> list[int]:
        """Deletes the committed steps that retention does not keep: the newest `keep_last`
        (the newest one when only `keep_interval` is set) and, with `keep_interval`, every step
        that is a multiple of it (DLRover's KeepStepIntervalStrategy).  Record first, then
        data, so a crash never leaves a record that points at deleted data.  A step's data
        that leaves its directory inside the checkpoint directory empty takes it along
        (DLRover's `<dir>/<step>/rank_0.pt` layout)."""
        newest = 1 if keep_last is None else keep_last
        if newest < 1:
            raise CheckpointError(f"keep_last={keep_last} must be at least 1")
        if keep_interval is not None and keep_interval < 1:
            raise CheckpointError(f"keep_interval={keep_interval} must be at least 1")
        records = self.records()
        keep = [
            r
            for i, r in enumerate(records)
            if i < newest or (keep_interval and r.step % keep_interval == 0)
        ]
        kept = {self.storage.path(r.path).rstrip("/") for r in keep}
        kept_steps = {r.step for r in keep}
        removed = []
        for old in records:
            if old.step in kept_steps:
                continue
            self.storage.remove(self.record_path(old.step))
            fault("retention:record_removed")
            data = self.storage.path(old.path).rstrip("/")
            if data not in kept and data != self.root:
                self.storage.remove(data)
                parent = posixpath.dirname(data)
                if self.root != "/" and parent.startswith(f"{self.root}/"):
                    self.storage.remove_empty_dir(parent)
            fault("retention:data_removed")
            removed.append(old.step)
        if removed:
            logger.info(
                "checkpoint retention removed_steps=%s keep_last=%s keep_interval=%s",
                removed,
                keep_last,
                keep_interval,
            )
        return removed
