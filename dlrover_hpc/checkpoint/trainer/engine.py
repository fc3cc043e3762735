"""The trainer side shared by every checkpointer: segments, the saver, events, storage.

`Engine` wires one checkpointer's parts together: this rank's two segments (`SegmentPair`),
the connection to its saver (`saver_connection`), GPU staging (`gpu_staging`), the event sink
and storage.  It keeps the bookkeeping of a save (segment meta, the persist request, the
event) and of a restore (the complete steps held in memory, the generation token).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
import weakref
from typing import Any

import torch

from dlrover_hpc.checkpoint.api import EventSink, PartKind, StorageType
from dlrover_hpc.checkpoint.env import WorkerEnv, local_ckpt_dir, segment_name
from dlrover_hpc.checkpoint.event_sinks import JsonlEventSink
from dlrover_hpc.checkpoint.saver.commit_records import CheckpointDir
from dlrover_hpc.checkpoint.saver.local_tier import LocalTier
from dlrover_hpc.checkpoint.saver.replicas import MAX_REPLICAS
from dlrover_hpc.checkpoint.saver.segments import Header, Segment, list_segments
from dlrover_hpc.checkpoint.saver.storage import Storage
from dlrover_hpc.checkpoint.trainer.cuda import SnapshotPolicy
from dlrover_hpc.checkpoint.trainer.earlier_worlds import drop_earlier_worlds
from dlrover_hpc.checkpoint.trainer.gpu_staging import DeferredSaves, HostPinner
from dlrover_hpc.checkpoint.trainer.memory_step import MemoryStep
from dlrover_hpc.checkpoint.trainer.saver_connection import SaverLink, connect
from dlrover_hpc.checkpoint.trainer.segment_pair import SegmentPair
from dlrover_hpc.checkpoint.trainer.tensor_copy import Copier
from dlrover_hpc.errors import CheckpointError
from dlrover_hpc.events import EventName
from dlrover_hpc.jobdir import EVENTS
from dlrover_hpc.worker import membership, progress

logger = logging.getLogger(__name__)


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
        keep_interval: int | None = None,
        replicas: int = 0,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last} must be at least 1 (or None: keep all)")
        if keep_interval is not None and keep_interval < 1:
            raise CheckpointError(f"keep_interval={keep_interval} must be at least 1 (or None)")
        self.env = env or WorkerEnv.from_environ()
        self.ckpt_dir = checkpoint_dir
        self.kind = kind
        self.keep_last = keep_last
        self.keep_interval = keep_interval  # also keep the multiples of it (keep_last or 1)
        self.tag = tag
        self.token = self.env.generation_token()
        ddp = kind == PartKind.DDP
        if replicas < 0:
            raise CheckpointError(f"replica_count={replicas} must be 0 or more")
        if replicas > MAX_REPLICAS:
            raise CheckpointError(
                f"replica_count={replicas}: at most {MAX_REPLICAS} copies of a node's parts"
            )
        #: peer nodes that keep a copy of this rank's part in memory (every node has DDP's)
        self.replicas = 0 if ddp else replicas
        #: DDP keeps one copy per node (local rank 0) and persists global rank 0's only
        self.writes_memory = not ddp or self.env.local_rank == 0
        self.persists = not ddp or self.env.rank == 0
        self.parts = 1 if ddp else self.env.world_size
        self.events = events if events is not None else _events_from_env(self.env)
        #: the job's own event log (not a caller's sink): the saves go through the saver
        self._reports_saves = events is None
        self.link = link or connect(
            self.env, events=self.events, io_threads=io_threads, parts_span_ranks=not ddp
        )
        self.copier = Copier(copy_threads)
        self.storage = Storage(checkpoint_dir, threads=io_threads)
        self.cdir = CheckpointDir(checkpoint_dir, self.storage)
        local_dir = local_ckpt_dir()
        #: the node-local tier (--local-ckpt-dir) a restore reads a step from first
        self.local_tier = (
            LocalTier(
                local_dir,
                shared_root=self.cdir.root,
                job=self.env.job_id,
                node=self.env.node_name,
            )
            if local_dir and self.storage.local
            else None
        )
        self.pinner = HostPinner()
        self.buffers = SegmentPair(
            self.segment_path,
            self.pinner,
            max_wait_s=max_wait_s,
            release=getattr(self.link, "release", None),  # a link of an older interface: None
        )
        #: the on-device snapshot and drain thread of saves that return early (GPU state)
        self.deferred = DeferredSaves(SnapshotPolicy.from_env(device_snapshot))
        self.last_disk_step: int | None = None
        #: no segment of an earlier world's ranks is left on this node (leader)
        self.no_earlier_world = False
        #: segments of other ranks opened for a restore and pinned ahead of it (DDP leader's)
        self._readers: dict[str, Segment] = {}
        self._closed = False
        atexit.register(_close_at_exit, weakref.ref(self))
        self._pin_existing_in_background()

    def segment_path(self, buffer: int, *, rank: int | None = None) -> str:
        rank = self.env.rank if rank is None else rank
        name = segment_name(self.link.prefix, rank=rank, buffer=buffer, tag=self.tag)
        return os.path.join(self.link.shm_dir, name)

    # ------------------------------------------------------------------------ saving
    def acquire(
        self, image_len: int, meta_len: int, device: torch.device | None = None
    ) -> tuple[Segment, float]:
        """A buffer locked for writing (see `SegmentPair.acquire`) once earlier saves are
        written."""
        self.wait_pending()
        return self.buffers.acquire(image_len, meta_len, device)

    def save_epoch(self, step: int) -> int:
        """Where a save starts: the number :meth:`finish` compares (see
        `membership.collectives_epoch`); refused while the round's collectives are aborted."""
        epoch = membership.collectives_epoch()
        if epoch is None:
            raise CheckpointError(
                f"step {step} not saved: this round's collectives were aborted for a "
                "membership change, so its state may hold a partial all-reduce"
            )
        return epoch

    def check_epoch(self, step: int, since: int) -> None:
        if membership.collectives_epoch() != since:
            raise CheckpointError(
                f"step {step} not kept: the round's collectives were aborted for a membership "
                "change while it was saved, so its state may hold a partial all-reduce; the "
                "previous step stays the newest"
            )

    def finish(
        self, seg: Segment, *, seq: int, step: int, image_len: int, meta: bytes, since: int
    ) -> None:
        """Marks the step whole in ``seg``, unless the round's collectives were aborted since
        the save began (``since``: :meth:`save_epoch`)."""
        self.check_epoch(step, since)
        self.buffers.finish(seg, seq=seq, step=step, image_len=image_len, meta=meta)

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
            "keep_interval": self.keep_interval,
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
        progress.saved(step)  # whole in memory: a straggler's node may go now
        self.buffers.prepare_second(seg.size, device)
        self.drop_earlier_worlds_segments()
        if self.replicas:
            try:  # the agent copies it to peers in the background
                self.link.replicate(seg.path, step, self.replicas)
            except CheckpointError as exc:
                logger.warning("checkpoint replicate_request_failed step=%d error=%s", step, exc)
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
        self.saved_event(step, storage_type, blocking_s, blocking_s if total_s is None else total_s)
        return ok

    def saved_event(
        self, step: int, storage_type: StorageType, blocking_s: float, total_s: float
    ) -> None:
        """``checkpoint_saved``: through the agent's saver, which writes one line per node and
        step (issue 29: one per rank is 32,768 lines per save at 4,096 nodes); the rank's own
        line without an agent, or when the saver cannot take it."""
        fields = {
            "step": step,
            "storage": storage_type.value,
            "blocking_s": round(blocking_s, 6),
            "total_s": round(total_s, 6),
        }
        report = getattr(self.link, "report", None)
        if self._reports_saves and callable(report) and self.events is not None:
            try:
                report(rank=self.env.rank, local_world=self.env.local_world_size, **fields)
                return
            except CheckpointError as exc:
                self._reports_saves = False  # an agent without it: from now on, as before
                logger.info("checkpoint saved_events_own reason=%s", exc)
        self.emit(EventName.CHECKPOINT_SAVED, **fields)

    def drop_earlier_worlds_segments(self) -> list[str]:
        return drop_earlier_worlds(self)

    def wait_pending(self) -> None:
        """Until the last deferred save (GPU snapshot drain) is in its segment."""
        self.deferred.wait_pending()

    def wait_prepared(self) -> None:
        """Until background buffer preparation is done (benchmarks, tests, close)."""
        self.buffers.wait_prepared()

    def prefault_in_background(self, device: torch.device | None = None) -> None:
        """After a restart the segments are mapped anew; populating their page tables off the
        training path keeps the next save at memcpy speed (a fresh mapping faults 3x slower);
        with a GPU they are page-locked too."""
        mapped = [s for s in self.buffers.segments if s is not None and s.mm is not None]
        self.buffers.warm_in_background(mapped, device)

    def _pin_existing_in_background(self) -> None:
        """After a restart, maps and page-locks the segments this rank will restore from, so
        `load_checkpoint` copies into the GPU at DMA speed without paying for it."""
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        device = torch.device("cuda", torch.cuda.current_device())
        owner = self._restore_rank()
        segments: list[Segment] = []
        for buffer in (0, 1):  # opened here: the thread only pins them
            path = self.segment_path(buffer, rank=owner)
            try:
                if owner == self.env.rank:
                    if os.path.exists(path):
                        segments.append(self.buffers.segment(buffer))
                else:
                    self._readers[path] = Segment(path, writable=False, shared_read=True)
                    segments.append(self._readers[path])
            except OSError as exc:
                logger.debug("checkpoint pin_existing_skipped path=%s error=%s", path, exc)
        self.buffers.warm_in_background(segments, device)

    # ------------------------------------------------------------------------ restoring
    def memory_parts(self) -> list[MemoryStep]:
        """The complete steps held in this node's segments of this checkpointer (job, tag,
        kind): this rank's own and those other ranks saved on this node, in this world or an
        earlier one.  After ranks moved between nodes, the part a rank needs, or one it can
        send to a peer, may sit under another rank's name (segments are named by the rank
        that saved them; DDP's by the node leader then).

        Does not wait for segments being page-locked in the background: a restore copies
        from them as they are (registering costs more than it saves for one copy)."""
        self.wait_pending()
        found: list[MemoryStep] = []
        mine = [self.buffers.existing(b) for b in (0, 1)]  # drops mappings of removed files
        shm, prefix = self.link.shm_dir, self.link.prefix
        # Copies of other nodes' parts (`replica_count`) count as this node's: `c` names.
        for name in list_segments(shm, prefix) + list_segments(shm, prefix, copies=True):
            path = self.segment_path(name.buffer, rank=name.rank)
            if name.copy:
                path = os.path.join(shm, prefix + "c" + os.path.basename(path)[len(prefix) :])
            if name.path != path:  # another checkpointer's (tag)
                continue
            ours = name.rank == self.env.rank and not name.copy
            seg = mine[name.buffer] if ours else self._reader(path)
            if seg is None or not seg.try_lock(exclusive=False):
                continue
            try:
                header = seg.header()
            finally:
                seg.unlock()
            part = self._part_of(header, name.rank) if header is not None else None
            if header is None or part is None:
                continue
            found.append(
                MemoryStep(
                    step=header.step,
                    buffer=name.buffer,
                    segment=seg,
                    header=header,
                    part=part[0],
                    parts=part[1],
                )
            )
        own = [ms for ms in found if ms.segment.path == self.segment_path(ms.buffer)]
        if own:  # the next save goes to the other buffer
            self.buffers.newest = max(own, key=lambda ms: ms.step).buffer
        return found

    def memory_steps(self) -> dict[int, MemoryStep]:
        """Step -> a segment of this node holding the part this rank needs of it."""
        return {ms.step: ms for ms in self.memory_parts() if (ms.part, ms.parts) == self.need}

    @property
    def need(self) -> tuple[int, int]:
        """The part this rank restores and how many parts a step has in this world."""
        if self.kind == PartKind.DDP:
            return (0, 1)
        return (self.env.rank, self.env.world_size)

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

    def _part_of(self, header: Header, rank: int) -> tuple[int, int] | None:
        """(part, parts) of a segment's step, None when it is not this checkpointer's kind:
        (0, 1) for DDP (every copy is the whole state), else (saving rank, its world)."""
        meta = header.meta
        if meta.get("kind") != self.kind.value:
            return None
        if self.kind == PartKind.DDP:
            return (0, 1)
        world = meta.get("world_size")
        if meta.get("rank") != rank or not isinstance(world, int):
            return None
        return (rank, world)

    def persist_restored(self, ms: MemoryStep, records: dict[int, Any]) -> None:
        """Persists a step restored from memory that a dead process saved and nobody persisted
        (no agent); with an agent, `SaverHost.persist_latest` did it before the restart."""
        if not self.link.in_process or not self.persists or not self.writes_memory:
            return
        if ms.segment.path != self.segment_path(ms.buffer):  # another rank saved it
            return
        if ms.header.meta.get("pid") == os.getpid() or max(records, default=-1) >= ms.step:
            return
        try:
            self.link.submit(ms.segment.path, ms.step)
        except CheckpointError as exc:
            logger.warning("checkpoint persist_after_restore_failed step=%d error=%s", ms.step, exc)

    @progress.sectioned("checkpoint")
    def wait_committed(self, step: int, timeout_s: float) -> bool:
        self.wait_pending()
        return self.link.wait_committed(self.ckpt_dir, step, timeout_s, self.env.rank, self.token)

    def set_token(self, token: int) -> None:
        self.token = token
        setter = getattr(self.link, "set_generation", None)
        if callable(setter):
            setter(token)

    # ------------------------------------------------------------------------ misc
    def emit(self, event: EventName, **fields: Any) -> None:
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
        self.deferred.close()
        self.buffers.wait_prepared()
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self.link.close()
        self.copier.close()
        remove = self.link.in_process if remove_segments is None else remove_segments
        self.buffers.close(remove=remove)
        self.storage.close()


def _close_at_exit(ref: Any) -> None:
    engine = ref()
    if engine is not None:
        # under an elastic launcher an exiting worker may be restarted: keep its memory
        engine.close(remove_segments=engine.link.in_process and not engine.env.run_id)


def _events_from_env(env: WorkerEnv) -> EventSink | None:
    if not env.job_dir:
        return None
    return JsonlEventSink(os.path.join(env.job_dir, EVENTS))
