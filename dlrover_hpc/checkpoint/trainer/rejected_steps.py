"""After a restore rejected steps: keep them from being loaded, persisted or counted again.

A rejected step (`restore_agreement.Rejection`, agreed by every rank) would otherwise stay
the newest in two places:
- **storage**: its commit record.  It would be chosen again at the next restart, counted by
  retention (`keep_last` keeps it and deletes good steps), and it would hide the good steps
  trained after the rollback from the agent, which persists on a failure only steps newer
  than the newest committed one.  Rank 0 renames the record to `step-<N>.json.rejected`
  (the loaders skip it; the step's files stay for inspection; renaming it back undoes it)
  and points `dlrover_latest.txt` back at the newest committed step left.
- **the generation token**: the ranks save with a new one from here on, so the saves trained
  again are never taken for the rejected generation's (`rollback_token`).
- **shared memory**: the segment holding it.  Each rank marks its own such segment empty
  (as a failed write leaves it), so no restart and no peer loads it, and the agent does not
  persist it again; and the next save goes to that buffer, not to the one just restored.

Only the save that was rejected goes: a step of the same number committed by another save
(another token) stays.  And only once an older step loaded: when none is left, the rejected
steps stay as they are, so every restart refuses them again, loudly, rather than finding
nothing and training from scratch.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping

from dlrover_hpc.checkpoint.saver.commit_records import CheckpointDir, CommitRecord
from dlrover_hpc.checkpoint.trainer.engine import Engine
from dlrover_hpc.checkpoint.trainer.memory_step import MemoryStep
from dlrover_hpc.checkpoint.trainer.restore_agreement import Rejection, Source

logger = logging.getLogger(__name__)

#: what a rejected commit record is renamed to (`CheckpointDir.records` skips it)
REJECTED_SUFFIX = ".rejected"


def forget_rejected(
    engine: Engine,
    rejections: Iterable[Rejection],
    *,
    held: Mapping[tuple[int, int, int, int], MemoryStep],
    records: Mapping[int, CommitRecord],
    rank: int,
) -> None:
    """Takes the rejected saves out of storage's commit records (rank 0) and out of this
    rank's own segments (every rank); see the module docstring."""
    for rejection in rejections:
        from_memory = rejection.source != Source.STORAGE
        record = records.get(rejection.step)
        if rank == 0 and record is not None and (not from_memory or record.token == rejection.save):
            _reject_record(engine.cdir, record)
        if from_memory:
            for ms in held.values():
                own = ms.segment.path == engine.segment_path(ms.buffer)
                if own and ms.step == rejection.step and ms.token == rejection.save:
                    _empty(ms)


def rollback_token(token: int, step: int) -> int:
    """The generation token the ranks save with after a restore that rejected newer steps:
    a new one, the same on every rank (from agreed values), so the saves trained again after
    the rollback are never taken for the rejected generation's (its commits, the saver's
    "already committed" answers)."""
    digest = hashlib.sha1(f"{token}/rollback/{step}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


def restored_buffer(engine: Engine, ms: MemoryStep) -> None:
    """The next save goes to the other buffer than the one just restored from (which holds
    the step training goes on from), even when that other one held a newer, rejected step."""
    if ms.segment.path == engine.segment_path(ms.buffer):
        engine.buffers.newest = ms.buffer


def _reject_record(cdir: CheckpointDir, record: CommitRecord) -> None:
    path = cdir.record_path(record.step)
    try:
        cdir.storage.write_bytes(path + REJECTED_SUFFIX, record.to_json())
        cdir.storage.remove(path)
        newest = cdir.newest_step()
        if cdir.tracker_step() == record.step and newest is not None:
            cdir.storage.write_bytes(cdir.tracker, f"{newest}\n".encode())
    except OSError as exc:
        logger.warning(
            "checkpoint reject_record_failed step=%d path=%s error=%s: the step stays "
            "committed, and a later restore rejects it again",
            record.step,
            path,
            exc,
        )
        return
    logger.warning(
        "checkpoint step_uncommitted step=%d record=%s%s: its files stay on storage; rename "
        "the record back to load it again",
        record.step,
        path,
        REJECTED_SUFFIX,
    )


def _empty(ms: MemoryStep) -> None:
    if not ms.segment.try_lock(exclusive=True):  # the saver still reads it: leave it
        logger.info("checkpoint rejected_segment_busy step=%d path=%s", ms.step, ms.segment.path)
        return
    try:
        ms.segment.invalidate()
    finally:
        ms.segment.unlock()
    logger.info("checkpoint rejected_segment_emptied step=%d path=%s", ms.step, ms.segment.path)
