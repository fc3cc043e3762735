"""The node-local checkpoint tier (``--local-ckpt-dir``): /dev/shm -> local disk -> shared.

With a local tier, the saver writes this node's parts of a step to the node's own disk first
(NVMe on real clusters), under the same layout as the shared checkpoint directory, then to the
shared directory from the same shared-memory buffer, where the commit protocol is unchanged
(`tier_writer`).  The buffer stays pinned until the shared write is done, so a local disk that
fails at any point costs no step.

Layout: ``<local dir>/<user>-<job>-<node>/<shared dir, made a file name>/`` mirrors the shared
directory; ``.dlrover-hpc/local/step-<N>.json`` there records which ranks' parts of step N (of
which save, its token) this node holds complete.  A restore reads a step from the local tier
when the shared commit record of that step has the same token and the local record covers what
this rank reads (`LocalTier.holds`); else it reads the shared copy.  The tier keeps the newest
`keep` steps and is removed when the job ends for good (`remove_job_tier`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import posixpath
import re
import shutil
import time

from dlrover_hpc.checkpoint.api import META_DIR
from dlrover_hpc.checkpoint.env import current_user, safe_component
from dlrover_hpc.checkpoint.saver.storage import Storage

logger = logging.getLogger(__name__)

#: Steps the local tier keeps when the checkpointer sets no keep_last.
DEFAULT_KEEP = 2
_RECORD = re.compile(r"^step-(\d+)\.json$")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LocalRecord:
    """This node's complete parts of one step in the local tier."""

    step: int
    token: int
    kind: str
    parts: int
    ranks: tuple[int, ...]
    path: str  # the step's shared path (the commit record's)
    time: float

    def to_json(self) -> bytes:
        data = {"format": 1, **dataclasses.asdict(self), "ranks": list(self.ranks)}
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> LocalRecord:
        data = json.loads(raw)
        return cls(
            step=int(data["step"]),
            token=int(data["token"]),
            kind=str(data["kind"]),
            parts=int(data["parts"]),
            ranks=tuple(sorted(int(r) for r in data["ranks"])),
            path=str(data["path"]),
            time=float(data["time"]),
        )

    def serves(self, rank: int) -> bool:
        """Whether a load by `rank` finds every file it reads here: all parts of the step
        (DDP's one file, DCP's shards and metadata), or this rank's own part (RANK kind)."""
        if set(self.ranks) >= set(range(self.parts)):
            return True
        return self.kind == "rank" and rank in self.ranks


def job_key(job_id: str | None, node: str) -> str:
    """The tier's directory name for one job on one node: user, job (a requeue keeps the job
    id) and node (a local directory that is shared by mistake still keeps nodes apart)."""
    return safe_component(f"{current_user()}-{job_id or 'local'}-{node}", limit=96)


def tier_root(local_dir: str, job: str | None, node: str, shared_root: str) -> str:
    """Where the local tier of the shared checkpoint directory `shared_root` lives."""
    name = safe_component(shared_root.strip("/").replace("/", "_") or "root", limit=80)
    return os.path.join(local_dir, job_key(job, node), name)


class LocalTier:
    """The local tier of one shared checkpoint directory on this node."""

    def __init__(self, local_dir: str, *, shared_root: str, job: str | None, node: str) -> None:
        self.shared_root = shared_root.rstrip("/") or "/"
        self.root = tier_root(local_dir, job, node, self.shared_root)
        self.storage = Storage(self.root, threads=2)
        self.records_dir = f"{self.root}/{META_DIR}/local"

    def local_path(self, shared_path: str) -> str | None:
        """The local twin of a path under the shared directory; None for one outside it."""
        shared_path = shared_path.rstrip("/")
        if shared_path == self.shared_root:
            return None
        if not shared_path.startswith(self.shared_root.rstrip("/") + "/"):
            return None
        rel = posixpath.relpath(shared_path, self.shared_root)
        if rel.startswith("..") or rel.startswith(META_DIR):
            return None
        return posixpath.join(self.root, rel)

    # ------------------------------------------------------------------ records
    def _record_path(self, step: int) -> str:
        return f"{self.records_dir}/step-{step:012d}.json"

    def record(self, step: int) -> LocalRecord | None:
        raw = self.storage.read_bytes(self._record_path(step))
        if raw is None:
            return None
        try:
            return LocalRecord.from_json(raw)
        except (ValueError, KeyError, TypeError):
            logger.warning("checkpoint local_tier_bad_record step=%d root=%s", step, self.root)
            return None

    def steps(self) -> list[int]:
        """The steps with a record, newest first."""
        names = self.storage.listdir(self.records_dir)
        return sorted((int(m.group(1)) for n in names if (m := _RECORD.match(n))), reverse=True)

    def add(
        self, *, step: int, token: int, kind: str, parts: int, ranks: tuple[int, ...], path: str
    ) -> LocalRecord:
        """Records `ranks`' parts of `step` as complete here (with those already recorded for
        the same save); written atomically, after the parts' files."""
        old = self.record(step)
        held = set(ranks) | (set(old.ranks) if old is not None and old.token == token else set())
        rec = LocalRecord(
            step=step,
            token=token,
            kind=kind,
            parts=parts,
            ranks=tuple(sorted(held)),
            path=path,
            time=time.time(),
        )
        self.storage.write_bytes(self._record_path(step), rec.to_json())
        return rec

    def drop(self, step: int) -> None:
        """Forgets `step` (its record first, so a crash never leaves a record without data)."""
        rec = self.record(step)
        self.storage.remove(self._record_path(step))
        if rec is None:
            return
        data = self.local_path(rec.path)
        if data is not None:
            self.storage.remove(data)
            parent = posixpath.dirname(data)
            if parent != self.root and parent.startswith(self.root + "/"):
                self.storage.remove_empty_dir(parent)

    def retain(self, keep: int) -> list[int]:
        """Keeps the newest `keep` steps (at least one); returns the steps removed."""
        removed = self.steps()[max(1, keep) :]
        for step in removed:
            self.drop(step)
        if removed:
            logger.info("checkpoint local_tier_retention removed_steps=%s keep=%d", removed, keep)
        return removed

    def holds(self, *, step: int, token: int, rank: int) -> LocalRecord | None:
        """The record when this tier holds what `rank` reads of save `token` of `step`."""
        rec = self.record(step)
        if rec is None or rec.token != token or not rec.serves(rank):
            return None
        return rec


def remove_job_tier(local_dir: str, job: str | None, node: str) -> bool:
    """Removes this job's local tier on this node (the job ended for good)."""
    path = os.path.join(local_dir, job_key(job, node))
    if not os.path.isdir(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    logger.info("checkpoint local_tier_removed dir=%s", path)
    return True


def job_tier_exists(local_dir: str, job: str | None, node: str) -> bool:
    return bool(local_dir) and os.path.isdir(os.path.join(local_dir, job_key(job, node)))
