"""The saver's writes to the node-local tier (`local_tier`), before each shared persist.

`TierWriter.write` puts this node's pending parts of one step into the local tier and records
them; the persist queue then writes the same parts to the shared directory as before.  A local
write that fails (a full, read-only or failing disk) is logged and reported once
(``checkpoint_local_tier_failed``) and that step goes straight to the shared tier, as without a
local tier; the next step tries the local disk again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

from dlrover_hpc.checkpoint.api import EventSink, FaultHook
from dlrover_hpc.checkpoint.saver.local_tier import DEFAULT_KEEP, LocalTier
from dlrover_hpc.checkpoint.saver.part_files import PartInfo, persist_part
from dlrover_hpc.checkpoint.saver.segments import Header
from dlrover_hpc.checkpoint.saver.storage import Storage, _no_fault
from dlrover_hpc.errors import CheckpointError
from dlrover_hpc.events import EventName

logger = logging.getLogger(__name__)


#: One queued part: its segment's header, what it is, and the segment's buffer.
Part = tuple[Header, PartInfo, Any]


class TierWriter:
    """Writes parts to the local tier of their checkpoint directory; thread-safe."""

    def __init__(
        self,
        local_dir: str,
        *,
        job: str | None,
        events: EventSink | None = None,
        node_name: str = "",
        fault: FaultHook | None = None,
    ) -> None:
        self.local_dir = local_dir
        self.job = job
        self._events = events
        self._node = node_name
        self._fault: FaultHook = fault or _no_fault
        self._lock = threading.Lock()
        self._tiers: dict[str, LocalTier] = {}
        self._failing = False  # the last local write failed (reported once until one works)

    def tier(self, shared: Storage, ckpt_dir: str) -> LocalTier:
        root = shared.path(ckpt_dir).rstrip("/") or "/"
        with self._lock:
            tier = self._tiers.get(root)
            if tier is None:
                tier = self._tiers[root] = LocalTier(
                    self.local_dir, shared_root=root, job=self.job, node=self._node
                )
            return tier

    def write(self, shared: Storage, parts: Sequence[Part]) -> LocalTier | None:
        """Writes `parts` (of one step and checkpoint directory) to the local tier and records
        them; the tier, or None when they were not written there (the path lies outside the
        checkpoint directory, the directory is not a file system path, or the write failed)."""
        if not parts or not shared.local:
            return None  # an object store: its restores read it there (no local twin)
        info = parts[0][1]
        tier = self.tier(shared, info.ckpt_dir)
        local_step = tier.local_path(shared.path(info.path))
        if local_step is None:
            return None
        ranks: list[int] = []
        try:
            self._fault("local:start")
            for header, part, buf in parts:
                persist_part(tier.storage, buf, header, fault=self._fault, step_path=local_step)
                ranks.extend(part.ranks)
            tier.add(
                step=info.step,
                token=info.token,
                kind=info.kind,
                parts=info.parts,
                ranks=tuple(ranks),
                path=info.path,
            )
            tier.retain(info.keep_last or DEFAULT_KEEP)
        except (OSError, CheckpointError) as exc:
            with contextlib.suppress(OSError, CheckpointError):
                tier.drop(info.step)  # no half-written step stays behind
                tier.storage.remove(local_step)
            self._failed(tier, info, exc)
            return None
        if self._failing:
            self._failing = False
            logger.info("checkpoint local_tier_recovered dir=%s step=%d", tier.root, info.step)
        return tier

    def _failed(self, tier: LocalTier, info: PartInfo, exc: BaseException) -> None:
        logger.warning(
            "checkpoint local_tier_failed step=%d dir=%s error=%s: this step goes straight to "
            "the shared checkpoint directory %s; fix: free space on (or replace) the local "
            "disk, or drop --local-ckpt-dir",
            info.step,
            tier.root,
            exc,
            info.ckpt_dir,
        )
        if self._failing:
            return
        self._failing = True
        if self._events is not None:
            self._events.emit(
                EventName.CHECKPOINT_LOCAL_TIER_FAILED,
                step=info.step,
                path=tier.root,
                error=str(exc),
                node=self._node,
            )
