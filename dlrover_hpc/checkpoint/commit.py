"""Commit: agreement that a step is complete, commit records, the tracker, retention.

A step is committed when every part is durable.  The saver that completes the set (told so by
a `CommitCoordinator`) writes a commit record `.dlrover-hpc/commits/step-<N>.json` and then
replaces `dlrover_latest.txt`, both atomically.  Loaders trust commit records, not the
tracker: the tracker is kept for DLRover's tools and for people.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import posixpath
import re
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from dlrover_hpc.checkpoint.api import META_DIR, TRACKER_FILE, FaultHook
from dlrover_hpc.checkpoint.storage import Storage, _no_fault
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)

_RECORD = re.compile(r"^step-(\d+)\.json$")


class LocalCommitCoordinator:
    """In-process, thread-safe part counting (one node, or one process)."""

    def __init__(self, *, remember: int = 1024) -> None:
        self._lock = threading.Lock()
        self._parts: dict[int, set[int]] = {}
        self._done: dict[int, None] = {}
        self._remember = remember

    def part_durable(self, *, step: int, ranks: Sequence[int], world_size: int, path: str) -> bool:
        with self._lock:
            if step in self._done:
                return False
            seen = self._parts.setdefault(step, set())
            seen.update(ranks)
            if len(seen) < world_size:
                return False
            del self._parts[step]
            self._done[step] = None
            while len(self._done) > self._remember:
                self._done.pop(next(iter(self._done)))
            return True

    def reset_pending(self) -> None:
        """Forgets parts of steps not yet committed (a new worker generation started)."""
        with self._lock:
            self._parts.clear()


class StoreCommitCoordinator:
    """Part counting in a torch.distributed Store (`add` is atomic) shared by all ranks.

    Used by the in-process saver under plain torchrun, where there is no master.  Keys are
    scoped by `namespace`, the worker generation, so parts of an older incarnation never count.
    """

    def __init__(self, store: Any, *, namespace: str = "0") -> None:
        self._store = store
        self.namespace = namespace

    @classmethod
    def from_env(
        cls, env: dict[str, str] | None = None, *, timeout_s: float = 30.0
    ) -> StoreCommitCoordinator:
        import torch.distributed as dist

        env = dict(os.environ) if env is None else env
        host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if not host or not port:
            raise CheckpointError(
                "WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set; launch with torchrun "
                "or dlrover-run so the ranks can agree on committed checkpoints"
            )
        store = dist.TCPStore(
            host,
            int(port),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        return cls(store)

    def part_durable(self, *, step: int, ranks: Sequence[int], world_size: int, path: str) -> bool:
        base = f"dlrover-hpc/ckpt/{self.namespace}/{step}"
        new = sum(1 for r in ranks if int(self._store.add(f"{base}/r{r}", 1)) == 1)
        if not new:
            return False
        return int(self._store.add(f"{base}/count", new)) == world_size


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


def wait_until(predicate: Any, timeout_s: float, *, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(interval_s, left))
