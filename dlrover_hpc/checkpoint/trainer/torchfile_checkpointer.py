"""Checkpointers whose persisted files are torch.save archives: DDP and per-rank.

`DdpCheckpointer` (DLRover's name and semantics): the state is the same on every rank, so
local rank 0 of each node keeps it in memory and global rank 0's copy goes to storage as one
file that plain `torch.load(path)` reads.  `RankCheckpointer`: every rank saves its own state
dict (nested dicts and lists, tensors, Python scalars, optimizer state) as
`path/rank_<rank>.pt`, and a step is committed when all ranks' files are durable.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import math
import os
import posixpath
import time
from typing import Any

import torch

from dlrover_hpc import environ
from dlrover_hpc.checkpoint.api import EventSink, PartKind, StorageType
from dlrover_hpc.checkpoint.env import WorkerEnv, spill_dir
from dlrover_hpc.checkpoint.formats.torchfile import (
    ARCHIVE,
    MANIFEST,
    TorchFileLayout,
    buffer_view,
    manifest_bytes,
    pickle_state,
    tensor_signature,
)
from dlrover_hpc.checkpoint.formats.torchfile_reader import views_from_file
from dlrover_hpc.checkpoint.saver.commit_records import CommitRecord
from dlrover_hpc.checkpoint.saver.part_files import file_path
from dlrover_hpc.checkpoint.saver.segments import HEADER_SIZE, Segment, needed_size
from dlrover_hpc.checkpoint.trainer.checkpointer import CheckpointerBase
from dlrover_hpc.checkpoint.trainer.cuda import DeviceSnapshot, cuda_device, target_device
from dlrover_hpc.checkpoint.trainer.restore_agreement import Load, Source
from dlrover_hpc.checkpoint.trainer.restore_check import Validate
from dlrover_hpc.checkpoint.trainer.restored_state import (
    StepBytes,
    merge_into,
    views_from_segment,
)
from dlrover_hpc.checkpoint.trainer.saver_connection import SaverLink
from dlrover_hpc.errors import CheckpointError, SegmentSpaceError
from dlrover_hpc.events import EventName
from dlrover_hpc.worker import progress

logger = logging.getLogger(__name__)


class _TorchFileCheckpointer(CheckpointerBase, abc.ABC):
    """Shared by the checkpointers that persist torch.save archives."""

    kind: PartKind

    def __init__(
        self,
        checkpoint_dir: str,
        *,
        keep_last: int | None = None,
        copy_threads: int | None = None,
        io_threads: int = 4,
        tag: str = "",
        verify: bool = True,
        weights_only: bool = True,
        events: EventSink | None = None,
        env: WorkerEnv | None = None,
        link: SaverLink | None = None,
        device_snapshot: bool | None = None,
        keep_interval: int | None = None,
        replica_count: int = 0,
        check_finite: bool = True,
        validate: Validate | None = None,
    ) -> None:
        super().__init__(
            checkpoint_dir,
            kind=self.kind,
            verify=verify,
            keep_last=keep_last,
            copy_threads=copy_threads,
            io_threads=io_threads,
            tag=tag,
            events=events,
            env=env,
            link=link,
            device_snapshot=device_snapshot,
            keep_interval=keep_interval,
            replicas=replica_count,
            check_finite=check_finite,
            validate=validate,
        )
        self.weights_only = weights_only
        self._layout: TorchFileLayout | None = None
        self._spilled = False  # said once that saves spill (shared memory has no room)

    @abc.abstractmethod
    def _file_name(self) -> str:
        """The part's file name under the step path ("" when the step path is the file)."""

    @abc.abstractmethod
    def _default_path(self, step: int) -> str:
        """The step path used when save_checkpoint gets none."""

    # ------------------------------------------------------------------------ saving
    @progress.sectioned("checkpoint")
    def save_checkpoint(
        self,
        step: int,
        state_dict: Any,
        path: str = "",
        storage_type: StorageType = StorageType.DISK,
    ) -> bool:
        """Copies `state_dict` into shared memory (the only blocking part); with DISK the
        agent's saver then persists it.  Returns False (with a warning) when the step could
        not be kept, in which case the previous checkpoint is untouched."""
        progress.step(step)  # a save is a progress signal (hang detection)
        t0 = time.perf_counter()
        engine = self._engine
        path = path or self._default_path(step)
        storage_type = self._stop_storage(step, storage_type)
        if not engine.writes_memory:
            if storage_type == StorageType.DISK:
                engine.last_disk_step = step
            return self._stop_if_asked(step, True)
        try:
            since = engine.save_epoch(step)
            saved = self._save(step, state_dict, path, storage_type, t0, since)
        except SegmentSpaceError as exc:
            saved = self._spill_or_fail(step, state_dict, path, storage_type, t0, exc, since)
        except CheckpointError as exc:
            self._save_failed(step, exc)
            saved = False
        return self._stop_if_asked(step, saved)

    def _spill_or_fail(
        self,
        step: int,
        state: Any,
        path: str,
        storage_type: StorageType,
        t0: float,
        why: SegmentSpaceError,
        since: int,
    ) -> bool:
        """Shared memory has no room for this save.  A DISK save goes to storage anyway,
        through a file in the spill directory (a disk: :func:`spill_dir`) that the saver
        persists like a segment; a MEMORY save is skipped.  Either way training goes on."""
        engine = self._engine
        if storage_type != StorageType.DISK or not engine.persists:
            self._save_failed(step, why)
            return False
        spill = os.path.join(spill_dir(), os.path.basename(engine.segment_path(0)) + "-spill")
        try:
            pkl, tensors = pickle_state(state)
            layout, tail, image_len, meta = self._image(step, pkl, tensors, path, storage_type)
            seg = Segment(spill, writable=True)
        except (OSError, CheckpointError) as exc:
            self._save_failed(step, f"{why}; spilling to {spill_dir()} failed too: {exc}")
            return False
        try:
            seg.lock(exclusive=True)
            seg.ensure_size(needed_size(image_len, len(meta) + 4096))
            seq = seg.begin_write()
            engine.copier.copy(list(zip(self._views(seg, layout), tensors, strict=True)))
            assert seg.mm is not None
            seg.mm[HEADER_SIZE + tail.offset : HEADER_SIZE + image_len] = tail.data
            engine.check_epoch(step, since)
            seg.finish_write(seq=seq, step=step, image_len=image_len, meta=meta)
            seg.unlock()
            engine.last_disk_step = step
            engine.link.submit(seg.path, step)  # the saver maps it: the name can go now
        except (OSError, CheckpointError) as exc:
            self._save_failed(step, f"{why}; spilling to {spill} failed too: {exc}")
            return False
        finally:
            seg.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spill)
        blocking = time.perf_counter() - t0
        if not self._spilled:
            self._spilled = True
            logger.warning(
                "checkpoint spilled step=%d seconds=%.3f: %s. This DISK save went to storage "
                f"through %s instead (set {environ.SPILL_DIR} to choose where); MEMORY saves "
                "are skipped until shared memory has room",
                step,
                blocking,
                why,
                spill_dir(),
            )
        engine.emit(
            EventName.CHECKPOINT_SAVED,
            step=step,
            storage=storage_type.value,
            blocking_s=round(blocking, 6),
            total_s=round(blocking, 6),
            spilled=str(why),
        )
        return True

    def _save(
        self, step: int, state: Any, path: str, storage_type: StorageType, t0: float, since: int
    ) -> bool:
        engine = self._engine
        pkl, tensors = pickle_state(state)
        device = cuda_device(tensors)
        snap = None
        if device is not None:
            cuda = [t for t in tensors if t.is_cuda]
            signature = tensor_signature(cuda)
            snap = engine.deferred.snapshot_for(device, cuda, signature)
        if snap is None:
            return self._write(
                step, pkl, tensors, path, storage_type, t0, since=since, device=device
            )
        # GPU tensors: copy on the device and return; the drain thread writes the segment
        taken = iter(snap.take(cuda, signature))
        sources = [next(taken) if t.is_cuda else t.clone() for t in tensors]
        blocking = time.perf_counter() - t0
        if storage_type == StorageType.DISK:
            engine.last_disk_step = step

        def write() -> None:
            try:
                self._write(
                    step,
                    pkl,
                    sources,
                    path,
                    storage_type,
                    t0,
                    since=since,
                    device=device,
                    snapshot=snap,
                    blocking_s=blocking,
                )
            except CheckpointError as exc:
                self._save_failed(step, exc)
            except Exception:  # the drain thread's boundary: log it, keep training
                logger.exception("checkpoint deferred_save_failed step=%d", step)
                engine.emit(EventName.CHECKPOINT_SAVE_FAILED, step=step, error="unexpected error")

        engine.deferred.defer(write)
        return True

    def _write(
        self,
        step: int,
        pkl: bytes,
        tensors: list[torch.Tensor],
        path: str,
        storage_type: StorageType,
        t0: float,
        *,
        since: int,
        device: torch.device | None,
        snapshot: DeviceSnapshot | None = None,
        blocking_s: float | None = None,
    ) -> bool:
        """Lays out the archive and fills a segment with it; with a snapshot, `tensors` holds
        its views and this runs on the drain thread."""
        engine = self._engine
        layout, tail, image_len, meta = self._image(step, pkl, tensors, path, storage_type)
        seg, waited = engine.acquire(image_len, len(meta) + 4096, device)
        try:
            seq = seg.begin_write()
            pairs = list(zip(self._views(seg, layout), tensors, strict=True))
            if snapshot is not None:
                snapshot.drain([(d, s) for d, s in pairs if s.is_cuda])
                pairs = [(d, s) for d, s in pairs if not s.is_cuda]
            engine.copier.copy(pairs)
            assert seg.mm is not None
            seg.mm[HEADER_SIZE + tail.offset : HEADER_SIZE + image_len] = tail.data
            engine.finish(seg, seq=seq, step=step, image_len=image_len, meta=meta, since=since)
        except BaseException:
            seg.invalidate()
            raise
        finally:
            seg.unlock()
        total = time.perf_counter() - t0
        logger.debug("checkpoint saved step=%d seconds=%.4f waited=%.4f", step, total, waited)
        return engine.after_write(
            seg,
            step=step,
            storage_type=storage_type,
            blocking_s=total if blocking_s is None else blocking_s,
            total_s=total,
            device=device,
        )

    def _image(
        self,
        step: int,
        pkl: bytes,
        tensors: list[torch.Tensor],
        path: str,
        storage_type: StorageType,
    ) -> tuple[TorchFileLayout, Any, int, bytes]:
        """The archive's layout, its tail, the image's length and the segment's metadata."""
        engine = self._engine
        layout = self._layout
        if layout is None or layout.signature != tensor_signature(tensors):
            layout = self._layout = TorchFileLayout(tensors)
        manifest = manifest_bytes(
            step=step, token=engine.token, rank=engine.env.rank, kind=self.kind.value
        )
        tail = layout.tail(pkl, {MANIFEST: manifest})
        image_len = tail.offset + len(tail.data)
        pkl_at = tail.records[f"{ARCHIVE}/data.pkl"][0]
        meta = engine.meta_bytes(
            step=step,
            path=path,
            storage_type=storage_type,
            files=[[self._file_name(), 0, image_len]],
            crc=tail.crc_patches,
            restore={
                "pickle": [pkl_at, len(pkl)],
                "slots": {s.key: s.offset for s in layout.slots},
            },
        )
        return layout, tail, image_len, meta

    @staticmethod
    def _views(seg: Segment, layout: TorchFileLayout) -> list[torch.Tensor]:
        """Tensor views of the layout's slots in `seg`, cached with the mapping."""
        cached = seg.views
        if cached is not None and cached[0] is layout:
            return list(cached[1])
        assert seg.mm is not None
        for at, header in layout.headers:
            seg.mm[HEADER_SIZE + at : HEADER_SIZE + at + len(header)] = header
        views = [
            buffer_view(seg.mm, HEADER_SIZE + s.offset, s.dtype, math.prod(s.shape)).view(s.shape)
            for s in layout.slots
        ]
        seg.views = (layout, views)
        return views

    # ------------------------------------------------------------------------ loading
    @progress.sectioned("checkpoint")
    def load_checkpoint(
        self,
        resume_path: str = "",
        *,
        state_dict: Any = None,
        weights_only: bool | None = None,
        memory: bool = True,
        storage: bool = True,
        validate: Validate | None = None,
    ) -> dict[str, Any]:
        """The newest consistent step: from memory when some rank holds it (a rank that lacks
        it receives it from one that holds it), else the newest committed step on storage ({}
        when there is none).  Tensors are copied into the
        matching tensors of `state_dict` when given, else into fresh memory.  Every rank must
        call it; `memory=False` reads storage only, `storage=False` memory only;
        `resume_path` reads that file (unchecked: the caller named it).

        The state is checked before it is returned (`restore_check`): a NaN or an infinity
        in a floating tensor (unless the checkpointer was made with check_finite=False), or
        `validate(state)` (this call's, else the constructor's) returning False, rejects the
        step on every rank, and the next older step is loaded instead (a `restore_rejected`
        event each).  `RestoreRejectedError` when no step is left and some was rejected."""
        t0 = time.perf_counter()
        wo = self.weights_only if weights_only is None else weights_only
        engine = self._engine
        if resume_path:
            buf = engine.storage.map_file(engine.storage.path(resume_path))
            views = views_from_file(buf, verify=self.verify, weights_only=wo)
            return merge_into(views, state_dict, engine.copier)

        def from_memory(held: StepBytes) -> Load:
            with held.reading():
                views = views_from_segment(held.buf, held.header, weights_only=wo)
                result = merge_into(views, state_dict, engine.copier)
            return lambda: (result, held.token)

        def from_storage(record: CommitRecord) -> Load:
            path = file_path(engine.storage.path(record.path), self._file_name())
            buf = engine.storage.map_file(path)
            views = views_from_file(
                buf,
                verify=self.verify,
                weights_only=wo,
                expect={"step": record.step, "token": record.token},
            )
            result = merge_into(views, state_dict, engine.copier)
            return lambda: (result, record.token)

        source, step, result = self._load_agreed(
            from_memory,
            from_storage,
            memory=memory,
            storage=storage,
            check=self._check_for(validate),
        )
        self._report_restored(source, step, t0, target_device(state_dict))
        if source == Source.NONE:
            return {}
        return result if isinstance(result, dict) else {"state": result}


class DdpCheckpointer(_TorchFileCheckpointer):
    """Flash checkpoints of a replicated (DDP) state dict; `torch.load(path)` reads a
    persisted one."""

    kind = PartKind.DDP

    def _file_name(self) -> str:
        return ""

    def _default_path(self, step: int) -> str:
        return posixpath.join(self.checkpoint_dir, f"checkpoint-{step}.pt")


class RankCheckpointer(_TorchFileCheckpointer):
    """Flash checkpoints of each rank's own state dict; `path/rank_<rank>.pt` per rank."""

    kind = PartKind.RANK

    def _file_name(self) -> str:
        return f"rank_{self._engine.env.rank:05d}.pt"

    def _default_path(self, step: int) -> str:
        return posixpath.join(self.checkpoint_dir, f"checkpoint-{step}")
