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
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dlrover_hpc.checkpoint.api import EventSink, PartKind, StorageType
from dlrover_hpc.checkpoint.dcp_storage import (
    METADATA_FILE,
    ShmStorageReader,
    ShmStorageWriter,
    VerifyingFileReader,
)
from dlrover_hpc.checkpoint.engine import Engine
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.link import SaverLink
from dlrover_hpc.checkpoint.restore import Agreement, Choice, Source, choose, with_fallback
from dlrover_hpc.checkpoint.shm import HEADER_SIZE, Segment
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)


class FsdpShardCheckpointer:
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
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.verify = verify
        self._engine = Engine(
            checkpoint_dir,
            kind=PartKind.DCP,
            env=env,
            keep_last=keep_last,
            copy_threads=copy_threads,
            io_threads=io_threads,
            tag=tag,
            events=events,
            link=link,
        )
        self._waited = 0.0
        #: (step, "memory" | "storage") of the last successful load_checkpoint()
        self.last_restored: tuple[int, str] | None = None

    @property
    def engine(self) -> Engine:
        return self._engine

    # ------------------------------------------------------------------------ saving
    def save_checkpoint(
        self,
        step: int,
        state_dict: dict[str, Any],
        path: str = "",
        storage_type: StorageType = StorageType.DISK,
    ) -> bool:
        """Runs a DCP save into shared memory (all ranks call it); DISK also persists."""
        t0 = time.perf_counter()
        engine = self._engine
        path = path or posixpath.join(self.checkpoint_dir, str(step))
        writer = ShmStorageWriter(
            acquire=self._acquire,
            copy=engine.copier.copy,
            rank=engine.env.rank,
            token=engine.token,
            path=path,
        )
        try:
            metadata = dcp.save(state_dict, storage_writer=writer)
            seg = self._finish(writer, metadata, step=step, path=path, storage_type=storage_type)
        except (CheckpointError, CheckpointException) as exc:
            if writer.result is not None:
                writer.result.segment.invalidate()
                writer.result.segment.unlock()
            logger.warning(
                "checkpoint save_failed step=%d error=%s: training continues and the previous "
                "checkpoint stays intact",
                step,
                exc,
            )
            engine.emit("checkpoint_save_failed", step=step, error=str(exc))
            return False
        blocking = time.perf_counter() - t0
        return engine.after_write(seg, step=step, storage_type=storage_type, blocking_s=blocking)

    def _acquire(self, image_len: int, meta_len: int, device: torch.device | None) -> Segment:
        seg, self._waited = self._engine.acquire(image_len, meta_len, device)
        return seg

    def _finish(
        self,
        writer: ShmStorageWriter,
        metadata: Any,
        *,
        step: int,
        path: str,
        storage_type: StorageType,
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
                seg, seq=result.seq, step=step, image_len=result.image_len, meta=meta
            )
        except BaseException:
            seg.invalidate()
            raise
        finally:
            seg.unlock()
        return seg

    # ------------------------------------------------------------------------ loading
    def _choose(self) -> tuple[Choice, dict[int, Any], dict[int, Any], Agreement]:
        engine = self._engine
        memory = engine.memory_steps()
        records = {r.step: r for r in engine.cdir.records()}
        agreement = Agreement()
        choice = choose(
            agreement,
            memory=set(memory),
            committed=sorted(records, reverse=True),
            token=engine.token,
        )
        engine.set_token(choice.token)
        return choice, memory, records, agreement

    def get_storage_reader(self) -> Any:
        """A DCP StorageReader for the newest consistent step (memory or storage), or None.
        Every rank must call it (it agrees on the source)."""
        choice, memory, records, _ = self._choose()
        if choice.source == Source.MEMORY:
            ms = memory[choice.step]
            self._engine.persist_restored(ms, records)
            return ShmStorageReader(ms.segment, ms.header)
        if choice.source == Source.STORAGE:
            return VerifyingFileReader(
                self._engine.storage, records[choice.step].path, verify=self.verify
            )
        return None

    def load_checkpoint(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Loads the newest consistent step into `state_dict` in place (DCP semantics) and
        returns it; {} when there is no checkpoint."""
        t0 = time.perf_counter()
        engine = self._engine
        choice, memory, records, agreement = self._choose()
        step, source = choice.step, choice.source
        if source == Source.MEMORY:
            ms = memory[step]
            try:
                dcp.load(state_dict, storage_reader=ShmStorageReader(ms.segment, ms.header))
                engine.persist_restored(ms, records)
            except (CheckpointException, CheckpointError) as exc:
                logger.warning("checkpoint memory_restore_failed step=%d error=%s", step, exc)
                source = Source.STORAGE
                step = max(records, default=-1)
        if source == Source.STORAGE:

            def load(s: int) -> tuple[Any, int]:
                reader = VerifyingFileReader(engine.storage, records[s].path, verify=self.verify)
                metadata = reader.read_metadata()
                dcp.load(state_dict, storage_reader=reader)
                save_id = getattr(metadata.storage_meta, "save_id", None) or "0"
                return state_dict, int(save_id, 16) if _is_hex(save_id) else 0

            step, loaded = with_fallback(agreement, list(records), step, load)
            if loaded is None:
                source = Source.NONE
        if source == Source.NONE:
            logger.info("checkpoint restore_none: no checkpoint in memory or storage")
            return {}
        seconds = time.perf_counter() - t0
        logger.info(
            "checkpoint restored step=%d source=%s seconds=%.3f", step, source.value, seconds
        )
        self.last_restored = (step, source.value)
        engine.prefault_in_background()
        engine.emit(
            "checkpoint_restored", step=step, source=source.value, restore_s=round(seconds, 6)
        )
        return state_dict

    def wait_latest_checkpoint(self, timeout_s: float = 1800.0) -> bool:
        step = self._engine.last_disk_step
        return True if step is None else self._engine.wait_committed(step, timeout_s)

    def close(self, *, remove_segments: bool | None = None) -> None:
        """Finishes this process's persists (without an agent) and releases the segments;
        they are removed unless an agent owns them (see `Engine.close`)."""
        self._engine.close(remove_segments=remove_segments)


def _is_hex(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return True
