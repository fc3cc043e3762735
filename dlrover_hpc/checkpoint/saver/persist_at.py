"""Persist the first save at or after a step, of every rank on this node, from shared memory.

The master's ``--persist-every`` (:mod:`dlrover_hpc.master.auto_persist`) tells every agent the
same step; each agent's saver arms this with it.  Every rank's first save at or after that step
(a save to memory as much as to disk) is then submitted to the saver's persist queue straight
from its segment, as a DISK save would be: the nodes persist the same step, so it commits, and
the workers' saves stay as fast as they are.  The same rule as a graceful stop's step
(:class:`dlrover_hpc.worker.progress.StopNotice`): ranks that save on one schedule pick one step.

A rank's save is caught in its report to the saver (the worker waits for the answer, so its
buffer cannot be overwritten meanwhile).  When the request comes after a rank already saved at
or after the step, the step is taken from its buffers only where they prove it the first such
save (it is the step itself, or the other buffer holds an older one); otherwise that rank is
left out and the step will not commit (the master asks again with a later step).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from dlrover_hpc.checkpoint.saver.part_files import PartInfo
from dlrover_hpc.checkpoint.saver.persist_queue import SaverCore
from dlrover_hpc.checkpoint.saver.segments import SegmentName
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)


def first_at_or_after(held: list[int], step: int) -> int | None:
    """Of the steps one rank's buffers hold, the one that is provably its first save at or
    after ``step`` (pure): ``step`` itself, or the smallest at or after it while another buffer
    holds a step before it; None when none is at or after it, or it cannot be told."""
    after = sorted(s for s in held if s >= step)
    if not after:
        return None
    if after[0] == step or any(s < step for s in held):
        return after[0]
    return None


class PersistAt:
    """Armed with a step (:meth:`arm`); submits each rank's first save at or after it."""

    def __init__(self, core: SaverCore, segments: Callable[[], list[SegmentName]]) -> None:
        self._core = core
        self._segments = segments
        self._lock = threading.Lock()
        self._step: int | None = None
        self._done: set[tuple[int, str]] = set()  # (rank, tag) submitted or given up, this arm

    @property
    def step(self) -> int | None:
        return self._step

    def arm(self, step: int) -> list[int]:
        """From now on, each rank's first save at or after ``step`` is persisted; the ranks
        that already made it are submitted now.  Returns the ranks submitted now."""
        with self._lock:
            self._step, self._done = int(step), set()
            return self._scan(rank=None, step=None)

    def saved(self, rank: int, step: int) -> None:
        """Rank ``rank`` reported its save of ``step`` (its buffer is whole and held)."""
        with self._lock:
            if self._step is None or step < self._step:
                return
            self._scan(rank=rank, step=step)

    def _scan(self, *, rank: int | None, step: int | None) -> list[int]:
        """Under the lock: ``rank`` None: every rank's buffers (at :meth:`arm`); else that
        rank's buffer holding ``step``, its first save at or after the armed step."""
        assert self._step is not None
        held: dict[tuple[int, str], dict[int, str]] = collections.defaultdict(dict)
        for seg in self._segments():
            if rank is not None and seg.rank != rank:
                continue
            header = self._core.peek_now(seg.path)
            if header is None or PartInfo.from_header(header) is None:
                continue
            held[(seg.rank, seg.tag)][header.step] = seg.path
        submitted = []
        for key, steps in sorted(held.items()):
            if key in self._done:
                continue
            chosen = step if step is not None else first_at_or_after(list(steps), self._step)
            if chosen is None or chosen not in steps:
                if any(s >= self._step for s in steps):  # past it already: cannot be told
                    self._done.add(key)
                    logger.warning(
                        "checkpoint persist_at_missed step=%d rank=%d held=%s: this rank "
                        "saved past it before the request came",
                        self._step,
                        key[0],
                        sorted(steps),
                    )
                continue
            self._done.add(key)
            try:
                self._core.submit(steps[chosen], step=chosen)
            except CheckpointError as exc:  # already queued (a DISK save of it), overwritten
                logger.info("checkpoint persist_at_skipped step=%d error=%s", chosen, exc)
                continue
            submitted.append(key[0])
            logger.info(
                "checkpoint persist_at step=%d rank=%d asked=%d", chosen, key[0], self._step
            )
        return submitted
