"""What every checkpointer shares: its engine, failure reporting, the agreed restore, waiting.

`DdpCheckpointer`, `RankCheckpointer` and `FsdpShardCheckpointer` differ in how a step is laid
out and loaded; they tell `CheckpointerBase` how to prepare a load of one step from a step's
bytes in memory or from storage, and it runs the restore every rank agrees on
(`restore_agreement`): one step for all ranks, each from its node's memory, a peer's memory
(`peer_transfer`) or storage, stepping back together when any rank cannot load it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from dlrover_hpc.checkpoint.api import EventSink, PartKind, StorageType
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.saver.commit_records import CommitRecord
from dlrover_hpc.checkpoint.trainer.engine import Engine
from dlrover_hpc.checkpoint.trainer.gpu_staging import close_later
from dlrover_hpc.checkpoint.trainer.memory_step import MemoryStep
from dlrover_hpc.checkpoint.trainer.peer_transfer import Outgoing, exchange, received_step
from dlrover_hpc.checkpoint.trainer.rejected_steps import (
    forget_rejected,
    restored_buffer,
    rollback_token,
)
from dlrover_hpc.checkpoint.trainer.restore_agreement import (
    Agreement,
    Choice,
    Holdings,
    Load,
    Rejection,
    Source,
    gather_holdings,
    plan_restore,
    restore_agreed,
)
from dlrover_hpc.checkpoint.trainer.restore_check import RestoreCheck, Validate
from dlrover_hpc.checkpoint.trainer.restored_state import StepBytes
from dlrover_hpc.checkpoint.trainer.saver_connection import SaverLink
from dlrover_hpc.checkpoint.trainer.tiered_restore import prepare_tiered
from dlrover_hpc.errors import CheckpointError, RestoreRejectedError
from dlrover_hpc.events import EventName
from dlrover_hpc.worker import progress

logger = logging.getLogger(__name__)


class CheckpointerBase:
    """The engine of one checkpointer and what all checkpointers do the same way."""

    def __init__(
        self,
        checkpoint_dir: str,
        *,
        kind: PartKind,
        verify: bool,
        keep_last: int | None,
        copy_threads: int | None,
        io_threads: int,
        tag: str,
        events: EventSink | None,
        env: WorkerEnv | None,
        link: SaverLink | None,
        device_snapshot: bool | None = None,
        keep_interval: int | None = None,
        replicas: int = 0,
        check_finite: bool = True,
        validate: Validate | None = None,
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.verify = verify
        #: what a restored state must pass (`restore_check`); `load_checkpoint(validate=)`
        #: replaces the user's check for one load
        self.restore_check = RestoreCheck(finite=check_finite, validate=validate)
        self._engine = Engine(
            checkpoint_dir,
            kind=kind,
            env=env,
            keep_last=keep_last,
            copy_threads=copy_threads,
            io_threads=io_threads,
            tag=tag,
            events=events,
            link=link,
            device_snapshot=device_snapshot,
            keep_interval=keep_interval,
            replicas=replicas,
        )
        #: (step, "memory" | "peer" | "storage" | "local") of the last successful load_checkpoint()
        self.last_restored: tuple[int, str] | None = None
        self._stopping: tuple[int, float] | None = None  # (step, deadline) of a stop save

    @property
    def engine(self) -> Engine:
        return self._engine

    # ------------------------------------------------------------------------ saving
    def _save_failed(self, step: int, error: BaseException | str) -> None:
        logger.warning(
            "checkpoint save_failed step=%d error=%s: training continues and the previous "
            "checkpoint stays intact",
            step,
            error,
        )
        self._engine.emit(EventName.CHECKPOINT_SAVE_FAILED, step=step, error=str(error))

    def _stop_storage(self, step: int, storage_type: StorageType) -> StorageType:
        """DISK when the job ends at this save (a time limit or preemption asked every rank
        to keep its first save at or after a step: `progress.stop_requested`)."""
        notice = progress.stop_requested()
        if notice is None or step < notice.step:
            return storage_type
        self._stopping = (step, notice.deadline)
        if not self._engine.writes_memory:  # DDP: the node's local rank 0 keeps the step
            logger.warning("checkpoint stop step=%d: this rank exits", step)
            return storage_type
        logger.warning("checkpoint stop_save step=%d: persisted, then this rank exits", step)
        return StorageType.DISK

    def _stop_if_asked(self, step: int, saved: bool) -> bool:
        """After the save `_stop_storage` made DISK: wait until it is committed (or the
        deadline), then end the process (exit code 0; the agent knows why)."""
        if self._stopping is None or self._stopping[0] != step:
            return saved
        deadline = self._stopping[1]
        self._stopping = None
        if not self._engine.writes_memory:
            # Every rank stops at this save, so no collective waits for this one; the rank
            # that holds the step waits for its commit.
            progress.mark_stopped(step)
            raise SystemExit(0)
        committed = saved and self.wait_latest_checkpoint(max(1.0, deadline - time.time()))
        logger.warning(
            "checkpoint stop step=%d committed=%s: the job continues from it in its next run",
            step,
            committed,
        )
        progress.mark_stopped(step)
        raise SystemExit(0)

    def wait_latest_checkpoint(self, timeout_s: float = 1800.0) -> bool:
        """Until the newest DISK save is committed on storage; False on timeout or failure."""
        self._engine.wait_pending()
        step = self._engine.last_disk_step
        return True if step is None else self._engine.wait_committed(step, timeout_s)

    def close(self, *, remove_segments: bool | None = None) -> None:
        """Finishes this process's persists (without an agent) and releases the segments;
        they are removed unless an agent owns them (see `Engine.close`)."""
        self._engine.close(remove_segments=remove_segments)

    # ------------------------------------------------------------------------ restoring
    def _load_agreed(
        self,
        from_memory: Callable[[StepBytes], Load],
        from_storage: Callable[[CommitRecord], Load],
        *,
        memory: bool = True,
        storage: bool = True,
        check: Callable[[Any], str | None] | None = None,
    ) -> tuple[Source, int, Any]:
        """The state of the step every rank agrees on, with this rank's source and the step;
        (NONE, -1, None) when there is none.  Every rank must call it.

        `from_memory` / `from_storage` do this rank's local part of a load (map, verify; it
        raises when this rank cannot load that step) and return the load proper, which may be
        collective: it runs only once every rank has prepared the same step.  `from_memory`
        gets the bytes of this rank's part: a segment of its node, or a peer's copy.
        `memory=False` / `storage=False` leave that source out (all ranks pass the same).

        `check` (`RestoreCheck.why_rejected` of what was loaded) rejects a step on any rank:
        every rank goes on to an older one, with a `restore_rejected` event, and once one
        loads the rejected saves are taken out of memory and storage (`rejected_steps`).
        When every step was rejected or unreadable and some was rejected, nothing is taken
        out (each later try says so again) and `RestoreRejectedError` is raised (storage
        searched too; with `storage=False` the caller's fallback decides: NONE)."""
        engine = self._engine
        held = {ms.key: ms for ms in (engine.memory_parts() if memory else [])}
        records = {r.step: r for r in (engine.cdir.records() if storage else [])}
        agreement = Agreement()
        mine = Holdings(
            memory=tuple(ms.as_part() for ms in held.values()),
            newest_committed=max(records, default=-1),
            token=engine.token,
            need=engine.need,
        )
        ranks = gather_holdings(agreement, mine)
        choice = plan_restore(ranks)
        engine.set_token(choice.token)

        local_reads: set[int] = set()  # the storage steps this rank read from its local tier

        def prepare(source: Source, step: int, plan: Choice) -> Load:
            if source != Source.STORAGE:
                return self._prepare_memory(agreement, plan, held, from_memory)
            record = records.get(step)
            if record is None:
                raise CheckpointError(f"no commit record for step {step} on this rank")
            return prepare_tiered(engine, record, from_storage, local_reads)

        rejections: list[Rejection] = []
        try:
            source, step, result, plan = restore_agreed(
                agreement,
                choice,
                records,
                prepare,
                check=check,
                ranks=ranks,
                on_rejected=lambda r: self._report_rejected(r, agreement.rank, rejections),
            )
        finally:
            for ms in held.values():  # other ranks' segments (the DDP node leader's, a peer's)
                if ms.segment.path != engine.segment_path(ms.buffer):
                    close_later(ms.segment)
        if source == Source.NONE and rejections and storage:
            raise RestoreRejectedError(_nothing_left(rejections, self.checkpoint_dir))
        if rejections and source != Source.NONE:  # with nothing left, every try says so
            forget_rejected(engine, rejections, held=held, records=records, rank=agreement.rank)
            engine.set_token(rollback_token(choice.token, step))
            gone = {r.step for r in rejections}
            records = {s: r for s, r in records.items() if s not in gone}  # storage's now
        if source == Source.STORAGE and step in local_reads:
            source = Source.LOCAL
        if source == Source.MEMORY:
            restored = held[(step, plan.save, *engine.need)]
            restored_buffer(engine, restored)
            engine.persist_restored(restored, records)
        return source, step, result

    def _check_for(self, validate: Validate | None) -> Callable[[Any], str | None] | None:
        """The check of one load: this checkpointer's, with `validate` (when given) in place
        of its own; None when nothing is checked."""
        check = self.restore_check
        if validate is not None:
            check = dataclasses.replace(check, validate=validate)
        return check.why_rejected if check.active else None

    def _report_rejected(self, rejection: Rejection, rank: int, seen: list[Rejection]) -> None:
        """The lowest rank that rejected a step writes its `restore_rejected` event (one per
        step, not one per rank); every rank keeps the list for the error when none is left."""
        seen.append(rejection)
        if rejection.by_rank != rank:
            return
        self._engine.emit(
            EventName.RESTORE_REJECTED,
            step=rejection.step,
            source=rejection.source.value,
            why=rejection.why or "",
            next_step=rejection.next_step,
            next_source=rejection.next_source.value,
        )

    def _prepare_memory(
        self,
        agreement: Agreement,
        choice: Choice,
        held: dict[tuple[int, int, int, int], MemoryStep],
        from_memory: Callable[[StepBytes], Load],
    ) -> Load:
        """This rank's try of the memory step: its part from its node's segment, or (when it
        lacks it) received from a peer in the load proper, after every rank has prepared; and
        the parts it sends to the ranks that lack them, in the same load."""
        engine = self._engine
        step, save = choice.step, choice.save
        fetch = choice.fetch(agreement.rank)
        local = from_memory(held[(step, save, *engine.need)]) if fetch is None else None
        sends = [(t, held[(step, save, t.part, t.parts)]) for t in choice.sends(agreement.rank)]

        def load() -> tuple[Any, int]:
            with contextlib.ExitStack() as reading:
                for _, ms in sends:
                    reading.enter_context(ms.reading())
                outgoing = [Outgoing(transfer=t, buf=ms.buf) for t, ms in sends]
                data = exchange(agreement, outgoing, fetch)
            if fetch is None:
                assert local is not None
                return local()
            kind = engine.kind.value
            part = received_step(data, want=fetch, step=step, save=save, kind=kind)
            return from_memory(part)()

        return load

    def _report_restored(
        self, source: Source, step: int, t0: float, device: torch.device | None = None
    ) -> None:
        """Logs and emits a finished restore; starts warming the segments for the next save."""
        if source == Source.NONE:
            logger.info("checkpoint restore_none: no checkpoint in memory or storage")
            return
        seconds = time.perf_counter() - t0
        logger.info(
            "checkpoint restored step=%d source=%s seconds=%.3f", step, source.value, seconds
        )
        self.last_restored = (step, source.value)
        progress.step(step)  # the optimizer steps count on from here (the goodput report)
        self._engine.prefault_in_background(device)
        self._engine.emit(
            EventName.CHECKPOINT_RESTORED,
            step=step,
            source=source.value,
            restore_s=round(seconds, 6),
        )


def _nothing_left(rejections: list[Rejection], checkpoint_dir: str) -> str:
    """The error of a restore that found no step to train on after rejecting some."""
    tried = "; ".join(
        f"step {r.step} ({r.source.value}): {r.why or f'rejected by rank {r.by_rank}'}"
        for r in rejections
    )
    return (
        f"checkpoint restore: no step left to train on in memory or in {checkpoint_dir}: "
        f"{tried}. No state was restored; starting over would silently lose the training "
        "so far. Fix: look at those steps (their files stay on storage), remove them to start "
        "over, or pass check_finite=False (or another validate=) to load them anyway"
    )
