"""Two small ledgers of the job master: a restart charge waiting for its grace, and the
checkpoint commit count kept in the journal."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from dlrover_hpc.checkpoint.saver.commits import CommitCounter
from dlrover_hpc.master.decisions import PEER_GRACE_S
from dlrover_hpc.master.journal import Journal
from dlrover_hpc.master.nodes import Clock

log = logging.getLogger(__name__)


class PendingCharge:
    """A peer-lost failure's restart, charged after :data:`PEER_GRACE_S` unless a node leaves
    first (then the failure was the membership change's symptom)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._pending: tuple[float, str] | None = None  # (deadline, reason)

    def later(self, reason: str) -> None:
        if self._pending is None:
            self._pending = (self._clock() + PEER_GRACE_S, reason)

    @property
    def pending(self) -> int:
        """1 while a charge waits out its grace, else 0: the restart count the workers of a
        round formed meanwhile are told counts it already (torchrun's count goes up with
        every failure restart; the grace only decides whether the job pays for it)."""
        return 0 if self._pending is None else 1

    def cancel(self) -> None:
        """A node left."""
        if self._pending is not None:
            log.info("restart not charged: a node left reason=%s", self._pending[1])
            self._pending = None

    def due(self) -> str | None:
        """The reason of a charge whose grace ran out (once), else None."""
        if self._pending is None or self._clock() < self._pending[0]:
            return None
        reason, self._pending = self._pending[1], None
        log.info("restart charged: no node left within the grace reason=%s", reason)
        return reason


class JournaledCommits(CommitCounter):
    """The job's checkpoint commit counter; every part it counts is also journaled (not
    fsynced: a part lost with the master's node only moves the commit to the next checkpoint),
    so a restarted master goes on counting where the old one stopped."""

    def __init__(self, journal: Journal | None) -> None:
        super().__init__()
        self._journal = journal
        #: step path -> its newest committed step: parts of it, or of an older step, never
        #: count again, so a compacted journal drops them
        self._newest: dict[str, int] = {}
        if journal is not None:
            journal.keep_part = self.still_counting

    def still_counting(self, part: Sequence[Any]) -> bool:
        """A journaled part (path, step, ranks, world size) of a step that may still commit."""
        path, step = part[0], part[1]
        return step > self._newest.get(path, -1)

    def replay(self, parts: Sequence[Sequence[Any]]) -> None:
        for path, step, ranks, world_size in parts:
            if super().part_durable(step=step, ranks=ranks, world_size=world_size, path=path):
                self._newest[path] = max(step, self._newest.get(path, -1))

    def part_durable(self, *, step: int, ranks: Sequence[int], world_size: int, path: str) -> bool:
        committed = super().part_durable(step=step, ranks=ranks, world_size=world_size, path=path)
        if committed:
            self._newest[path] = max(step, self._newest.get(path, -1))
        if self._journal is not None:
            self._journal.append(sync=False, ckpt_part=[path, step, list(ranks), world_size])
        return committed
