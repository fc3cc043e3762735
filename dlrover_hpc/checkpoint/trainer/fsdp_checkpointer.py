"""`FsdpShardCheckpointer`: flash checkpoints of sharded state dicts through DCP.

Saving runs `torch.distributed.checkpoint.save` with a shared-memory StorageWriter; the saver
persists each rank's part in DCP's own file layout (`__<rank>_<token>.distcp` plus rank 0's
`.metadata`), so `torch.distributed.checkpoint.load(sd, checkpoint_id=path)` reads it without
this package.  `get_storage_reader()` (DLRover's name) returns the reader for the newest
consistent step; `load_checkpoint(state_dict)` loads it in place, stepping back on failure.
"""

from __future__ import annotations

import logging
import pickle
import posixpath
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dlrover_hpc.checkpoint.api import EventSink, PartKind, StorageType
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.formats.dcp_layout import METADATA_FILE
from dlrover_hpc.checkpoint.saver.commit_records import CommitRecord
from dlrover_hpc.checkpoint.saver.segments import HEADER_SIZE, Segment
from dlrover_hpc.checkpoint.trainer.checkpointer import CheckpointerBase
from dlrover_hpc.checkpoint.trainer.dcp_readers import ShmStorageReader, VerifyingFileReader
from dlrover_hpc.checkpoint.trainer.dcp_writer import ShmStorageWriter
from dlrover_hpc.checkpoint.trainer.restore_agreement import Load, Source
from dlrover_hpc.checkpoint.trainer.restore_check import Validate
from dlrover_hpc.checkpoint.trainer.restored_state import StepBytes
from dlrover_hpc.checkpoint.trainer.saver_connection import SaverLink
from dlrover_hpc.errors import CheckpointError
from dlrover_hpc.worker import progress

logger = logging.getLogger(__name__)


class FsdpShardCheckpointer(CheckpointerBase):
    """DLRover's FSDP flash checkpointer: DCP state dicts (FSDP SHARDED_STATE_DICT, DTensor)."""

    def __init__(
        self,
        checkpoint_dir: str,
        *,
        keep_last: int | None = None,
        copy_threads: int | None = None,
        io_threads: int = 4,
        tag: str = "",
        verify: bool = True,
        events: EventSink | None = None,
        env: WorkerEnv | None = None,
        link: SaverLink | None = None,
        keep_interval: int | None = None,
        replica_count: int = 0,
        check_finite: bool = True,
        validate: Validate | None = None,
    ) -> None:
        super().__init__(
            checkpoint_dir,
            kind=PartKind.DCP,
            verify=verify,
            keep_last=keep_last,
            copy_threads=copy_threads,
            io_threads=io_threads,
            tag=tag,
            events=events,
            env=env,
            link=link,
            keep_interval=keep_interval,
            replicas=replica_count,
            check_finite=check_finite,
            validate=validate,
        )

    # ------------------------------------------------------------------------ saving
    @progress.sectioned("checkpoint")
    def save_checkpoint(
        self,
        step: int,
        state_dict: dict[str, Any],
        path: str = "",
        storage_type: StorageType = StorageType.DISK,
    ) -> bool:
        """Runs a DCP save into shared memory (all ranks call it); DISK also persists."""
        progress.step(step)  # a save is a progress signal (hang detection)
        t0 = time.perf_counter()
        engine = self._engine
        path = path or posixpath.join(self.checkpoint_dir, str(step))
        storage_type = self._stop_storage(step, storage_type)
        writer = ShmStorageWriter(
            acquire=self._acquire,
            copy=engine.copier.copy,
            rank=engine.env.rank,
            token=engine.token,
            path=path,
        )
        try:
            since = engine.save_epoch(step)
            metadata = dcp.save(state_dict, storage_writer=writer)
            seg = self._finish(
                writer, metadata, step=step, path=path, storage_type=storage_type, since=since
            )
        except (CheckpointError, CheckpointException) as exc:
            if writer.result is not None:
                writer.result.segment.invalidate()
                writer.result.segment.unlock()
            self._save_failed(step, exc)
            return self._stop_if_asked(step, False)
        blocking = time.perf_counter() - t0
        saved = engine.after_write(seg, step=step, storage_type=storage_type, blocking_s=blocking)
        return self._stop_if_asked(step, saved)

    def _acquire(self, image_len: int, meta_len: int, device: torch.device | None) -> Segment:
        seg, _ = self._engine.acquire(image_len, meta_len, device)
        return seg

    def _finish(
        self,
        writer: ShmStorageWriter,
        metadata: Any,
        *,
        step: int,
        path: str,
        storage_type: StorageType,
        since: int,
    ) -> Segment:
        result = writer.result
        if result is None:
            raise CheckpointError("DCP finished without writing this rank's part")
        seg = result.segment
        assert seg.mm is not None
        try:
            files = list(result.files)
            if writer.is_coordinator:
                raw = pickle.dumps(writer.metadata or metadata)
                if len(raw) > result.metadata_room:
                    raise CheckpointError(
                        f"DCP metadata of {len(raw)} bytes exceeds the {result.metadata_room} "
                        "bytes reserved for it"
                    )
                at = HEADER_SIZE + result.metadata_at
                seg.mm[at : at + len(raw)] = raw
                files.append([METADATA_FILE, result.metadata_at, result.metadata_at + len(raw)])
            meta = self._engine.meta_bytes(
                step=step,
                path=path,
                storage_type=storage_type,
                files=files,
                crc=result.crc,
                restore=result.restore,
            )
            self._engine.finish(
                seg, seq=result.seq, step=step, image_len=result.image_len, meta=meta, since=since
            )
        except BaseException:
            seg.invalidate()
            raise
        finally:
            seg.unlock()
        return seg

    # ------------------------------------------------------------------------ loading
    def get_storage_reader(self, *, storage: bool = True) -> Any:
        """A DCP StorageReader for the newest consistent step (memory, a peer's memory or
        storage; memory only with `storage=False`), or None.  Every rank must call it (the
        ranks agree on the step)."""

        def from_memory(held: StepBytes) -> Load:
            reader = ShmStorageReader(held)
            return lambda: (reader, held.token)

        def from_storage(record: CommitRecord) -> Load:
            reader = VerifyingFileReader(self._engine.storage, record.path, verify=self.verify)
            return lambda: (reader, record.token)

        return self._load_agreed(from_memory, from_storage, storage=storage)[2]

    @progress.sectioned("checkpoint")
    def load_checkpoint(
        self,
        state_dict: dict[str, Any],
        *,
        storage: bool = True,
        validate: Validate | None = None,
    ) -> dict[str, Any]:
        """Loads the newest consistent step into `state_dict` in place (DCP semantics) and
        returns it; {} when there is no checkpoint.  Every rank must call it.  The loaded
        state is checked as `DdpCheckpointer.load_checkpoint` checks it (each rank its own
        shards): a rejected step is replaced by the next older one."""
        loaded = self.load_with(
            lambda reader: dcp.load(state_dict, storage_reader=reader),
            storage=storage,
            state=lambda: state_dict,
            validate=validate,
        )
        return state_dict if loaded else {}

    def load_with(
        self,
        load: Callable[[Any], object],
        *,
        storage: bool = True,
        state: Callable[[], Any] | None = None,
        validate: Validate | None = None,
    ) -> bool:
        """Runs `load(reader)`, a collective load of the caller's making over a DCP
        StorageReader (several `dcp.load` calls, FSDP's `load_sharded_optimizer_state_dict`),
        on the step every rank agrees on, stepping back together when it fails on any rank.
        False when there is no checkpoint (memory only with `storage=False`).  Every rank must
        call it.  With `state` (what the load filled, e.g. the state dicts it loaded into),
        that is checked after each load (`restore_check`); without it nothing is."""
        t0 = time.perf_counter()
        check = self._check_for(validate) if state is not None else None
        checked = None if check is None or state is None else _checking(check, state)

        def from_memory(held: StepBytes) -> Load:
            reader = ShmStorageReader(held)
            return lambda: (_collective_load(load, reader), held.token)

        def from_storage(record: CommitRecord) -> Load:
            reader = VerifyingFileReader(self._engine.storage, record.path, verify=self.verify)
            metadata = reader.read_metadata()  # this rank can read the step: then all load it
            save_id = getattr(metadata.storage_meta, "save_id", None) or "0"
            signature = int(save_id, 16) if _is_hex(save_id) else 0
            return lambda: (_collective_load(load, reader), signature)

        source, step, _ = self._load_agreed(
            from_memory, from_storage, storage=storage, check=checked
        )
        self._report_restored(source, step, t0)
        return source != Source.NONE


def _checking(
    check: Callable[[Any], str | None], state: Callable[[], Any]
) -> Callable[[Any], str | None]:
    """The check of what a load filled (the load itself returns no state)."""
    return lambda _: check(state())


def _collective_load(load: Callable[[Any], object], reader: Any) -> bool:
    """`load(reader)`; DCP gathers every rank's error, so all ranks fail together."""
    try:
        load(reader)
    except CheckpointException as exc:  # a BaseException: made an error the restore handles
        raise CheckpointError(
            f"torch.distributed.checkpoint.load failed: {_failures(exc)}"
        ) from exc
    return True


def _failures(exc: CheckpointException) -> str:
    """The failing ranks and their errors, without DCP's tracebacks."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return str(exc)
    parts = []
    for rank, wrapped in sorted(failures.items()):
        error = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        parts.append(f"rank {rank}: {error}")
    return "; ".join(parts)


def _is_hex(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return True
