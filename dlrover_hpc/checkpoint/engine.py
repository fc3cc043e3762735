"""The trainer side shared by every checkpointer: two segments, their locks, the saver link.

A save takes a buffer under LOCK_EX: the one not holding the newest step when the saver has
not pinned it, else the other one; only when the saver pins both (two persists queued) does a
save wait, and that wait is logged and reported as blocking time.  Segments stay mapped for
the life of the process; the second one is created and pre-faulted in a background thread.

With GPU tensors the segments are page-locked for CUDA (`cuda.register_host`), and a save may
return after an on-device snapshot while one drain thread writes the segment (`defer`); every
path that reads or writes segments waits for that drain first.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from dlrover_hpc.checkpoint.api import EventSink, PartKind, StorageType
from dlrover_hpc.checkpoint.commit import CheckpointDir
from dlrover_hpc.checkpoint.cuda import DeviceSnapshot, SnapshotPolicy, register_host
from dlrover_hpc.checkpoint.env import WorkerEnv, segment_name
from dlrover_hpc.checkpoint.events import JsonlEventSink
from dlrover_hpc.checkpoint.link import SaverLink, connect
from dlrover_hpc.checkpoint.shm import Header, Segment, needed_size
from dlrover_hpc.checkpoint.storage import Storage
from dlrover_hpc.checkpoint.transfer import Copier
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)

#: threads that pre-fault a segment before it is page-locked (first-touch zeroing scales)
PREFAULT_THREADS = 8


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemoryStep:
    """A complete step found in a segment."""

    step: int
    buffer: int
    segment: Segment
    header: Header


class Engine:
    """Segments, saver link, events and storage access for one checkpointer."""

    def __init__(
        self,
        checkpoint_dir: str,
        *,
        kind: PartKind,
        env: WorkerEnv | None = None,
        keep_last: int | None = None,
        copy_threads: int | None = None,
        io_threads: int = 4,
        tag: str = "",
        events: EventSink | None = None,
        link: SaverLink | None = None,
        max_wait_s: float = 600.0,
        device_snapshot: bool | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last} must be at least 1 (or None: keep all)")
        self.env = env or WorkerEnv.from_environ()
        self.ckpt_dir = checkpoint_dir
        self.kind = kind
        self.keep_last = keep_last
        self.tag = tag
        #: longest a save waits for the saver to release a buffer before it is skipped
        self.max_wait_s = max_wait_s
        self.token = self.env.generation_token()
        ddp = kind == PartKind.DDP
        #: DDP keeps one copy per node (local rank 0) and persists global rank 0's only
        self.writes_memory = not ddp or self.env.local_rank == 0
        self.persists = not ddp or self.env.rank == 0
        self.parts = 1 if ddp else self.env.world_size
        self.events = events if events is not None else _events_from_env(self.env)
        self.link = link or connect(
            self.env, events=self.events, io_threads=io_threads, parts_span_ranks=not ddp
        )
        self.copier = Copier(copy_threads)
        self.storage = Storage(checkpoint_dir, threads=io_threads)
        self.cdir = CheckpointDir(checkpoint_dir, self.storage)
        self._segments: list[Segment | None] = [None, None]
        self._newest: int | None = None
        self._lock = threading.Lock()
        #: creates and pre-faults the second buffer after the first save (acquire waits for it)
        self._prepare: threading.Thread | None = None
        #: re-populates page tables of segments mapped after a restart (nobody waits for it)
        self._warm: threading.Thread | None = None
        self.last_disk_step: int | None = None
        #: whether a save of GPU state may return after an on-device copy
        self.snapshot_policy = SnapshotPolicy.from_env(device_snapshot)
        self._snapshot: DeviceSnapshot | None = None
        #: one thread writes deferred saves into the segments, in order
        self._drainer: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._thread = threading.local()
        self._pin_lock = threading.Lock()
        self._pin_refused = False
        #: segments of other ranks opened for a restore and pinned ahead of it (DDP leader's)
        self._readers: dict[str, Segment] = {}
        self._closed = False
        atexit.register(_close_at_exit, weakref.ref(self))
        self._pin_existing_in_background()

    # ------------------------------------------------------------------------ naming
    def segment_path(self, buffer: int, *, rank: int | None = None) -> str:
        rank = self.env.rank if rank is None else rank
        name = segment_name(self.link.prefix, rank=rank, buffer=buffer, tag=self.tag)
        return os.path.join(self.link.shm_dir, name)

    def _segment(self, buffer: int) -> Segment:
        seg = self._segments[buffer]
        if seg is None:
            seg = Segment(self.segment_path(buffer), writable=True)
            self._segments[buffer] = seg
        return seg

    # ------------------------------------------------------------------------ writing
    def acquire(
        self, image_len: int, meta_len: int, device: torch.device | None = None
    ) -> tuple[Segment, float]:
        """A buffer locked for writing and large enough (page-locked for `device`, a GPU);
        returns it and the seconds waited."""
        self.wait_pending()
        if self._prepare is not None:
            self._prepare.join()
            self._prepare = None
        if device is not None and self._warm is not None:  # it may be pinning these segments
            self._warm.join()
            self._warm = None
        order = [0, 1] if self._newest is None else [1 - self._newest, self._newest]
        size = needed_size(image_len, meta_len)
        t0 = time.perf_counter()
        while True:
            for buffer in order:
                seg = self._segment(buffer)
                if seg.try_lock(exclusive=True):
                    waited = time.perf_counter() - t0
                    if waited > 0.01:
                        logger.warning(
                            "checkpoint save_blocked seconds=%.3f: both shared-memory buffers "
                            "were waiting to be persisted; save to DISK less often than a "
                            "persist takes",
                            waited,
                        )
                    self._grow(seg, size)
                    if device is not None:
                        self.pin(seg, device)
                    return seg, waited
            if time.perf_counter() - t0 > self.max_wait_s:
                raise CheckpointError(
                    f"both shared-memory buffers stayed pinned by the saver for "
                    f"{self.max_wait_s:.0f} s (is storage hanging?); this save is skipped"
                )
            time.sleep(0.005)  # the saver unpins a buffer when its persist ends

    def _grow(self, seg: Segment, size: int) -> Segment:
        try:
            seg.ensure_size(size)
        except CheckpointError:
            seg.unlock()
            raise
        return seg

    def buffer_of(self, seg: Segment) -> int:
        return self._segments.index(seg)

    def finish(self, seg: Segment, *, seq: int, step: int, image_len: int, meta: bytes) -> None:
        seg.finish_write(seq=seq, step=step, image_len=image_len, meta=meta)
        self._newest = self.buffer_of(seg)

    def meta_bytes(
        self, *, step: int, path: str, storage_type: StorageType, **fields: Any
    ) -> bytes:
        part = {"ranks": [self.env.rank], "parts": self.parts} if self.persists else None
        meta = {
            "format": 1,
            "step": step,
            "rank": self.env.rank,
            "world_size": self.env.world_size,
            "kind": self.kind.value,
            "token": self.token,
            "ckpt_dir": self.ckpt_dir,
            "path": path,
            "keep_last": self.keep_last,
            "persist": storage_type == StorageType.DISK,
            "part": part,
            "pid": os.getpid(),
            "time": time.time(),
            **fields,
        }
        return json.dumps(meta, separators=(",", ":")).encode()

    def after_write(
        self,
        seg: Segment,
        *,
        step: int,
        storage_type: StorageType,
        blocking_s: float,
        total_s: float | None = None,
        device: torch.device | None = None,
    ) -> bool:
        """Starts the second buffer's preparation, asks for a persist, emits the event
        (`blocking_s`: training was held; `total_s`: until the step was whole in memory)."""
        ok = True
        if self._segments[1] is None and self._prepare is None:
            self._prepare = threading.Thread(
                target=self._prepare_other,
                args=(seg.size, device),
                name="ckpt-prefault",
                daemon=True,
            )
            self._prepare.start()
        if storage_type == StorageType.DISK:
            self.last_disk_step = step
            if self.persists:
                try:
                    self.link.submit(seg.path, step)
                except CheckpointError as exc:
                    ok = False
                    logger.warning(
                        "checkpoint persist_request_failed step=%d error=%s: the step stays in "
                        "memory only; training continues",
                        step,
                        exc,
                    )
        self.emit(
            "checkpoint_saved",
            step=step,
            storage=storage_type.value,
            blocking_s=round(blocking_s, 6),
            total_s=round(blocking_s if total_s is None else total_s, 6),
        )
        return ok

    def _prepare_other(self, size: int, device: torch.device | None) -> None:
        try:
            seg = self._segment(1)
            if not seg.try_lock(exclusive=True):
                return
            try:
                seg.ensure_size(size)
            finally:
                seg.unlock()
            self._warm_up(seg, device)
        except (OSError, CheckpointError) as exc:
            logger.warning("checkpoint second_buffer_failed error=%s", exc)

    def _warm_up(self, seg: Segment, device: torch.device | None) -> None:
        """Off the training path: page-locks `seg` for a GPU, else populates its page tables."""
        if device is not None:
            self.pin(seg, device)
        else:
            seg.prefault()

    # ------------------------------------------------------------------------ GPU
    def pin(self, seg: Segment, device: torch.device) -> bool:
        """Page-locks `seg` for CUDA once per mapping (pre-faulting it first on several
        threads, which is 10x faster than letting the registration fault it)."""
        if seg.pin is not None:
            return True
        with self._pin_lock:
            if self._pin_refused or seg.mm is None:
                return False
            if seg.pin is not None:
                return True
            t0 = time.perf_counter()
            seg.prefault(threads=PREFAULT_THREADS)
            seg.pin = register_host(seg.address(), seg.size, device)
            if seg.pin is None:
                self._pin_refused = True
                return False
            logger.debug(
                "checkpoint pinned path=%s bytes=%d seconds=%.3f",
                seg.path,
                seg.size,
                time.perf_counter() - t0,
            )
            return True

    def snapshot_for(
        self, device: torch.device, tensors: list[torch.Tensor], signature: tuple[Any, ...]
    ) -> DeviceSnapshot | None:
        """The device snapshot to take this save into, or None to copy to host now.

        Waits for the previous save's drain (the snapshot is reused)."""
        if not self.snapshot_policy.enabled:
            return None
        self.wait_pending()
        snap = self._snapshot
        if snap is None or snap.device != device:
            if snap is not None:
                snap.release()
            snap = self._snapshot = DeviceSnapshot(device, self.snapshot_policy)
        if not snap.fits(tensors, signature):
            snap.release()
            logger.info(
                "checkpoint device_snapshot_skipped: the GPU has no room for a second copy of "
                "the state; this save copies to shared memory directly"
            )
            return None
        return snap

    def defer(self, write: Callable[[], None]) -> None:
        """Runs `write` (the rest of a save) on the drain thread; the next caller of
        `wait_pending` waits for it."""
        if self._drainer is None:
            self._drainer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-drain")

        def run() -> None:
            self._thread.draining = True  # its own acquire() must not wait for itself
            write()

        self._pending = self._drainer.submit(run)

    def wait_pending(self) -> None:
        if getattr(self._thread, "draining", False):
            return
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @staticmethod
    def close_later(seg: Segment) -> None:
        """Closes another rank's segment off the caller's path (unpinning 2 GiB takes 40 ms)."""
        if seg.pin is None:
            seg.close()
            return
        threading.Thread(target=seg.close, name="ckpt-unpin", daemon=True).start()

    def _pin_existing_in_background(self) -> None:
        """After a restart, maps and page-locks the segments this rank will restore from, so
        `load_checkpoint` copies into the GPU at DMA speed without paying for it."""
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        device = torch.device("cuda", torch.cuda.current_device())
        owner = self._restore_rank()
        paths = [self.segment_path(b, rank=owner) for b in (0, 1)]
        segments: list[Segment] = []
        for buffer, path in enumerate(paths):  # opened here: the thread only pins them
            try:
                if owner == self.env.rank:
                    if os.path.exists(path):
                        segments.append(self._segment(buffer))
                else:
                    self._readers[path] = Segment(path, writable=False, shared_read=True)
                    segments.append(self._readers[path])
            except OSError as exc:
                logger.debug("checkpoint pin_existing_skipped path=%s error=%s", path, exc)
        if not segments:
            return

        def run() -> None:
            for seg in segments:
                self.pin(seg, device)

        self._warm = threading.Thread(target=run, name="ckpt-pin", daemon=True)
        self._warm.start()

    def wait_prepared(self) -> None:
        """Until background buffer preparation is done (benchmarks, tests, close)."""
        for thread in (self._prepare, self._warm):
            if thread is not None:
                thread.join()

    def prefault_in_background(self, device: torch.device | None = None) -> None:
        """After a restart the segments are mapped anew; populating their page tables off the
        training path keeps the next save at memcpy speed (a fresh mapping faults 3x slower);
        with a GPU they are page-locked too."""
        segments = [seg for seg in self._segments if seg is not None and seg.mm is not None]
        if not segments or (self._warm is not None and self._warm.is_alive()):
            return

        def run() -> None:
            for seg in segments:
                self._warm_up(seg, device)

        self._warm = threading.Thread(target=run, name="ckpt-prefault", daemon=True)
        self._warm.start()

    # ------------------------------------------------------------------------ reading
    def memory_steps(self) -> dict[int, MemoryStep]:
        """Complete steps held in this rank's segments (the node leader's for DDP).

        Does not wait for segments being page-locked in the background: a restore copies
        from them as they are (registering costs more than it saves for one copy)."""
        self.wait_pending()
        if self._prepare is not None:
            self._prepare.join()
            self._prepare = None
        rank = self._restore_rank()
        found: dict[int, MemoryStep] = {}
        for buffer in (0, 1):
            path = self.segment_path(buffer, rank=rank)
            if rank == self.env.rank:
                if not os.path.exists(path):
                    continue
                seg = self._segment(buffer)
                seg.remap_if_grown()
            else:
                opened = self._reader(path)
                if opened is None:
                    continue
                seg = opened
            if not seg.try_lock(exclusive=False):
                continue
            try:
                header = seg.header()
            finally:
                seg.unlock()
            if header is None or not self._usable(header):
                continue
            found[header.step] = MemoryStep(
                step=header.step, buffer=buffer, segment=seg, header=header
            )
        if rank == self.env.rank and found:
            self._newest = found[max(found)].buffer
        return found

    def _restore_rank(self) -> int:
        """Whose segments this rank restores from: its own, or its node leader's for DDP."""
        if self.kind == PartKind.DDP:
            return self.env.rank - self.env.local_rank
        return self.env.rank

    def _reader(self, path: str) -> Segment | None:
        """Another rank's segment for reading: the one pinned ahead of the restore if it is
        still current, else mapped now (None when it does not exist)."""
        seg = self._readers.pop(path, None)
        if seg is not None and not seg.stale():
            return seg
        if seg is not None:
            seg.close()
        try:
            return Segment(path, writable=False, shared_read=True)
        except FileNotFoundError:
            return None
        except PermissionError:  # not ours to map shared: a private copy reads too
            try:
                return Segment(path, writable=False, private=True)
            except FileNotFoundError:
                return None

    def _usable(self, header: Header) -> bool:
        meta = header.meta
        if meta.get("kind") != self.kind.value:
            return False
        return self.kind == PartKind.DDP or meta.get("world_size") == self.env.world_size

    def persist_restored(self, ms: MemoryStep, records: dict[int, Any]) -> None:
        """Persists a step restored from memory that a dead process saved and nobody persisted
        (no agent); with an agent, `SaverHost.persist_latest` did it before the restart."""
        if not self.link.in_process or not self.persists or not self.writes_memory:
            return
        if ms.header.meta.get("pid") == os.getpid() or max(records, default=-1) >= ms.step:
            return
        try:
            self.link.submit(ms.segment.path, ms.step)
        except CheckpointError as exc:
            logger.warning("checkpoint persist_after_restore_failed step=%d error=%s", ms.step, exc)

    def wait_committed(self, step: int, timeout_s: float) -> bool:
        self.wait_pending()
        return self.link.wait_committed(self.ckpt_dir, step, timeout_s, self.env.rank, self.token)

    def set_token(self, token: int) -> None:
        self.token = token
        setter = getattr(self.link, "set_generation", None)
        if callable(setter):
            setter(token)

    # ------------------------------------------------------------------------ misc
    def emit(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(event, rank=self.env.rank, node=self.env.node_name, **fields)

    def close(self, *, remove_segments: bool | None = None) -> None:
        """Waits for this process's persists (in-process saver) and releases the segments.

        Segments are removed when this process owns the saver (no agent); under an agent
        they stay for a restart and the agent removes them at job end.  At interpreter exit
        without close(), a worker of an elastic launcher keeps them for its restart (a later
        run sweeps those of finished standalone jobs).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_pending()
        finally:
            if self._drainer is not None:
                self._drainer.shutdown(wait=True)
        self.wait_prepared()
        if self._snapshot is not None:
            self._snapshot.release()
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self.link.close()
        self.copier.close()
        remove = self.link.in_process if remove_segments is None else remove_segments
        for seg in self._segments:
            if seg is None:
                continue
            seg.close()
            if remove:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(seg.path)
        self.storage.close()


def _close_at_exit(ref: Any) -> None:
    engine = ref()
    if engine is not None:
        # under an elastic launcher an exiting worker may be restarted: keep its memory
        engine.close(remove_segments=engine.link.in_process and not engine.env.run_id)


def _events_from_env(env: WorkerEnv) -> EventSink | None:
    if not env.job_dir:
        return None
    return JsonlEventSink(os.path.join(env.job_dir, "events.jsonl"))
