"""The saver: persists pinned segments in a background thread and commits complete steps.

It runs in the agent (`SaverHost`), so segments and persists outlive a crashed worker, or in
the training process itself when there is no agent (`trainer.saver_connection.InProcessSaver`).
It never imports torch.  One persist thread takes requests in arrival order, persisting all
pending parts of one step together (each file with several I/O threads), then reports them to the
`CommitCoordinator`; the one caller that completes a step writes its commit record.

A queued step keeps its buffer pinned (LOCK_SH), so saves use the rank's other buffer.  Only
when a save finds both pinned (one persisting, one queued behind it: storage is slower than the
saves, or hangs) does it ask :meth:`SaverCore.release` for the queued one instead of waiting:
that step is superseded (``checkpoint_superseded``), and when the persist in flight ends, the
newest step the released buffer holds is persisted in its place.  So training never waits for
storage, and the newest step is the one that becomes durable when storage answers again
(:mod:`.stalls` reports the wait as ``persist_stalled``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

from dlrover_hpc.checkpoint.api import CommitCoordinator, EventSink, FaultHook
from dlrover_hpc.checkpoint.saver.commit_records import CheckpointDir, CommitRecord
from dlrover_hpc.checkpoint.saver.part_files import PartInfo, persist_part
from dlrover_hpc.checkpoint.saver.segments import Header, Segment
from dlrover_hpc.checkpoint.saver.space import check_space
from dlrover_hpc.checkpoint.saver.stalls import StallWatch
from dlrover_hpc.checkpoint.saver.storage import Storage, _no_fault
from dlrover_hpc.checkpoint.saver.tier_writer import TierWriter
from dlrover_hpc.errors import CheckpointError
from dlrover_hpc.events import EventName

logger = logging.getLogger(__name__)
SAY_EVERY_S = 5.0  # a persist that outlasts this on close says what is left, this often


#: Checkpoint directories whose storage is kept open (a worker may name any in a request).
MAX_STORAGES = 16
#: How long the persist thread waits between tries to pin a released buffer a save writes.
PIN_RETRY_S = 0.01


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Durability:
    """Where this node's persists to one checkpoint directory stand (read at the job's end)."""

    ckpt_dir: str
    wanted: int  # the newest step this node was asked to persist
    durable: int  # the newest step committed on storage (-1: none)
    error: str = ""  # the newest persist failure, "" when none


@dataclasses.dataclass(slots=True, kw_only=True)
class _Request:
    path: str
    segment: Segment
    header: Header
    info: PartInfo


class SaverCore:
    """Persist queue, commit and waiting; thread-safe."""

    def __init__(
        self,
        *,
        commit: CommitCoordinator,
        events: EventSink | None = None,
        node_name: str = "",
        io_threads: int = 4,
        fault: FaultHook | None = None,
        drop_cache: bool = True,
        tiers: TierWriter | None = None,
    ) -> None:
        """``tiers``: the node-local tier (``--local-ckpt-dir``) each step goes to first."""
        self._commit = commit
        self.tiers = tiers
        self._events = events
        self._node = node_name
        self._io_threads = io_threads
        self._user_fault: FaultHook = fault or _no_fault
        self._drop_cache = drop_cache
        self.stalls = StallWatch(events=events, node=node_name)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._busy = False
        self._stopping = False
        self._segments: dict[str, Segment] = {}
        self._pinned: set[str] = set()
        self._owed: dict[str, _Request] = {}  # released buffers: their newer step is persisted
        self._storages: dict[str, Storage] = {}
        self._durable: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=256)
        self._failed: dict[int, int] = {}
        self._committed: dict[str, int] = {}
        self._wanted: dict[str, int] = {}  # per checkpoint directory: the newest step submitted
        self._errors: dict[str, str] = {}  # per checkpoint directory: the newest failure
        self._low_space: set[str] = set()  # directories warned about (until room returns)
        self._token: int | None = None
        self._thread: threading.Thread | None = None

    def _fault(self, point: str) -> None:
        """Every named point of a persist is progress (:class:`StallWatch`), then the test seam."""
        self.stalls.progress()
        self._user_fault(point)

    # ------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckpt-saver", daemon=True)
                self._thread.start()
        self.stalls.start()

    def close(self, *, timeout_s: float = 600.0) -> bool:
        """Finishes queued persists (up to `timeout_s`), then stops; True if all finished."""
        idle = self._drain(timeout_s)
        with self._cond:
            self._stopping = True
            for req in self._queue:
                self._unpin(req.path)
            self._queue.clear()
            self._owed.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=max(1.0, timeout_s))
        self.stalls.close()
        with self._cond:
            for seg in self._segments.values():
                seg.close()
            self._segments.clear()
            self._pinned.clear()
        for storage in self._storages.values():
            storage.close()
        return idle

    # ------------------------------------------------------------------------ requests
    def submit(self, path: str, *, step: int) -> None:
        """Pins the segment at `path` (which must hold `step`) and queues its persist."""
        with self._cond:
            if self._stopping:
                raise CheckpointError("the checkpoint saver is shutting down")
            if path in self._pinned:
                raise CheckpointError(f"{path} is already queued for persisting")
            seg = self._segment(path)
            if not seg.try_lock(exclusive=False):
                raise CheckpointError(f"{path} is being written; cannot persist step {step}")
            header = seg.header()
            info = PartInfo.from_header(header) if header else None
            if header is None or header.step != step or info is None:
                seg.unlock()
                held = header.step if header else None
                raise CheckpointError(
                    f"{path} holds step {held}, not a persistable step {step}; "
                    "it was overwritten or never completed"
                )
            self._observe_token(info.token)
            self._owed.pop(path, None)  # this newer step pays what the buffer owed
            self._pinned.add(path)
            self._queue.append(_Request(path=path, segment=seg, header=header, info=info))
            self._wanted[info.ckpt_dir] = max(self._wanted.get(info.ckpt_dir, -1), step)
            self._cond.notify_all()

    def release(self, path: str) -> bool:
        """A save found both of its rank's buffers pinned (one persisting, one queued behind
        it: storage is slower than the saves, or hangs).  Unpins the queued one, so the save
        takes it instead of waiting; the step it held is superseded: once the persist in flight
        ends, whatever newer step that buffer holds then is persisted in its place.  False when
        `path` is not queued (it is being persisted, or was never submitted)."""
        with self._cond:
            req = next((r for r in self._queue if r.path == path), None)
            if req is None:
                return False
            self._queue.remove(req)
            self._unpin(path)
            self._owed[path] = req
        self._superseded(req.info)
        return True

    def _settle_owed(self) -> None:
        """Under the lock, the persist thread idle: each released buffer's newest step (at
        least the step it owed, same directory) is queued; one a save is writing waits."""
        for path, old in list(self._owed.items()):
            seg = old.segment
            if path in self._pinned or not seg.try_lock(exclusive=False):
                continue
            header = seg.header()
            info = PartInfo.from_header(header) if header else None
            del self._owed[path]
            if (
                header is None
                or info is None
                or info.ckpt_dir != old.info.ckpt_dir
                or info.token != old.info.token
                or header.step < old.info.step
                or any(
                    r.info.ckpt_dir == info.ckpt_dir and r.info.step >= header.step
                    for r in self._queue
                )
            ):
                # no newer step of that save, or a queued one is newer (steps commit in order)
                seg.unlock()
                continue
            self._pinned.add(path)
            self._queue.append(_Request(path=path, segment=seg, header=header, info=info))
            self._wanted[info.ckpt_dir] = max(self._wanted.get(info.ckpt_dir, -1), header.step)
            logger.info(
                "checkpoint superseded step=%d persisting=%d path=%s",
                old.info.step,
                header.step,
                path,
            )

    def _superseded(self, info: PartInfo) -> None:
        logger.info(
            "checkpoint superseded step=%d path=%s: it waited for storage behind another persist "
            "and a newer save took its buffer; the newest step is persisted in its place",
            info.step,
            info.path,
        )
        if self._events is not None:
            self._events.emit(
                EventName.CHECKPOINT_SUPERSEDED,
                step=info.step,
                ranks=list(info.ranks),
                path=info.path,
                node=self._node,
            )

    def _segment(self, path: str) -> Segment:
        seg = self._segments.get(path)
        if seg is not None and path not in self._pinned and path not in self._owed and seg.stale():
            seg.close()
            seg = None
        if seg is None:
            seg = Segment(path, writable=False)
            self._segments[path] = seg
        else:
            seg.remap_if_grown()
        return seg

    def _unpin(self, path: str) -> None:
        if path not in self._pinned:
            return
        seg = self._segments.get(path)
        if seg is not None:
            seg.unlock()
        self._pinned.discard(path)

    def _observe_token(self, token: int) -> None:
        if self._token is not None and token != self._token:
            logger.info("checkpoint new_generation token=%x", token)
            # what the previous generation committed says nothing of this one's steps (after
            # a rejected restore it trains again steps older than those)
            with self._cond:
                self._committed.clear()
            reset = getattr(self._commit, "new_generation", None)
            if callable(reset):
                reset()
        self._token = token

    # ------------------------------------------------------------------------ persist loop
    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._owed:
                        self._settle_owed()
                    if self._queue or self._stopping:
                        break
                    self._cond.wait(PIN_RETRY_S if self._owed else None)
                if self._stopping and not self._queue:
                    return
                first = self._queue[0]
                batch = [
                    r
                    for r in self._queue
                    if r.info.step == first.info.step and r.info.ckpt_dir == first.info.ckpt_dir
                ]
                for r in batch:
                    self._queue.remove(r)
                self._busy = True
            self.stalls.started(first.info.step, first.info.path)
            try:
                self._persist_batch(batch)
            except Exception as exc:  # thread boundary: log once, keep serving
                logger.exception("checkpoint saver_error step=%d", first.info.step)
                with self._cond:
                    self._errors[first.info.ckpt_dir] = f"step {first.info.step}: {exc!r}"
            finally:
                self.stalls.finished()
                with self._cond:
                    for r in batch:
                        self._unpin(r.path)
                    self._busy = False
                    self._cond.notify_all()

    def _storage(self, ckpt_dir: str) -> Storage:
        with self._cond:
            storage = self._storages.pop(ckpt_dir, None)
            if storage is None:
                storage = Storage(ckpt_dir, threads=self._io_threads, drop_cache=self._drop_cache)
                while len(self._storages) >= MAX_STORAGES:  # the least recently used goes
                    self._storages.pop(next(iter(self._storages))).close()
            self._storages[ckpt_dir] = storage  # the newest use last
            return storage

    def _persist_batch(self, batch: list[_Request]) -> None:
        info = batch[0].info
        storage = self._storage(info.ckpt_dir)
        cdir = CheckpointDir(info.ckpt_dir, storage)
        t0 = time.perf_counter()
        self._fault("persist:start")
        existing = cdir.record(info.step)
        if existing is not None and existing.token != info.token:
            logger.warning(
                "checkpoint recommit step=%d path=%s: an older save of this step is replaced",
                info.step,
                info.path,
            )
            cdir.uncommit(info.step)
            existing = None
        if existing is None:
            self._write_local_tier(storage, batch)
        done: list[int] = []
        nbytes = 0
        for req in batch:
            if existing is not None or self._is_durable(req.info):
                done.extend(req.info.ranks)
                continue
            try:
                nbytes += persist_part(storage, req.segment.mm, req.header, fault=self._fault)
            except (OSError, CheckpointError) as exc:
                self._report_failure(req.info, exc)
                continue
            with self._cond:
                for rank in req.info.ranks:
                    self._durable.append((rank, info.step, info.token))
            done.extend(req.info.ranks)
        # The parts are on storage: training may reuse their buffers while the commit is
        # agreed (with a master that is restarting, that can take seconds).
        with self._cond:
            for req in batch:
                self._unpin(req.path)
            self._cond.notify_all()
        if not done:
            return
        won = False
        if existing is None:
            try:
                won = self._commit.part_durable(
                    step=info.step, ranks=sorted(done), world_size=info.parts, path=info.path
                )
            except Exception as exc:  # the coordinator is a remote service: report, go on
                logger.warning("checkpoint commit_unreachable step=%d error=%s", info.step, exc)
            if won:
                record = CommitRecord(
                    step=info.step,
                    path=info.path,
                    kind=info.kind,
                    parts=info.parts,
                    token=info.token,
                    time=time.time(),
                )
                try:
                    cdir.commit(record, fault=self._fault, **info.retention())
                except OSError as exc:
                    self._report_failure(info, exc)
                    return
        if won or existing is not None:
            with self._cond:
                root = cdir.root
                self._committed[root] = max(self._committed.get(root, -1), info.step)
        if nbytes:
            check_space(
                storage,
                cdir.root,
                info,
                nbytes // max(1, len(done)),
                warned=self._low_space,
                events=self._events,
                node=self._node,
            )
        seconds = time.perf_counter() - t0
        logger.info(
            "checkpoint persisted step=%d ranks=%s seconds=%.3f bytes=%d committed=%s",
            info.step,
            sorted(done),
            seconds,
            nbytes,
            won,
        )
        if self._events is not None:
            self._events.emit(
                EventName.CHECKPOINT_PERSISTED,
                step=info.step,
                persist_s=round(seconds, 6),
                ranks=sorted(done),
                bytes=nbytes,
                committed=won,
                node=self._node,
                path=info.path,
            )

    def _write_local_tier(self, storage: Storage, batch: list[_Request]) -> None:
        """The parts not yet durable go to the node-local tier first (`tier_writer`): a
        failure there is reported, and the step goes to the shared directory all the same."""
        if self.tiers is None:
            return
        parts = [(r.header, r.info, r.segment.mm) for r in batch if not self._is_durable(r.info)]
        try:
            self.tiers.write(storage, parts)
        except Exception:  # the local tier is an extra: it never costs the shared persist
            logger.exception("checkpoint local_tier_error step=%d", batch[0].info.step)

    def _is_durable(self, info: PartInfo) -> bool:
        with self._cond:
            return all((r, info.step, info.token) in self._durable for r in info.ranks)

    def _report_failure(self, info: PartInfo, exc: BaseException) -> None:
        with self._cond:
            for rank in info.ranks:
                self._failed[rank] = info.step
            self._errors[info.ckpt_dir] = f"step {info.step}: {exc}"
        logger.warning(
            "checkpoint persist_failed step=%d ranks=%s path=%s error=%s: training continues "
            "and the previous checkpoint stays intact",
            info.step,
            list(info.ranks),
            info.path,
            exc,
        )
        if self._events is not None:
            self._events.emit(
                EventName.CHECKPOINT_PERSIST_FAILED,
                step=info.step,
                ranks=list(info.ranks),
                error=str(exc),
                node=self._node,
            )

    # ------------------------------------------------------------------------ waiting
    def _drain(self, timeout_s: float) -> bool:
        """:meth:`wait_idle`, saying every few seconds what is left: a large checkpoint
        persisting on exit is a wait the user sits through."""
        if self._thread is None:
            return self.wait_idle(timeout_s)  # nothing runs: no wait to speak of
        t0 = time.monotonic()
        while not self.wait_idle(min(SAY_EVERY_S, max(0.0, t0 + timeout_s - time.monotonic()))):
            if time.monotonic() - t0 >= timeout_s:
                return False
            with self._cond:
                queued, busy = [r.header.step for r in self._queue], self._busy
            logger.info(
                "checkpoint persisting before exit: %d part(s) queued%s%s, %.0f s of %.0f s",
                len(queued),
                f" (steps {','.join(map(str, sorted(set(queued))))})" if queued else "",
                ", one being written" if busy else "",
                time.monotonic() - t0,
                timeout_s,
            )
        return True

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy or self._owed:
                left = deadline - time.monotonic()
                if left <= 0 or (self._thread is None and not self._busy):
                    return False
                self._cond.wait(left)
            return True

    def wait_committed(
        self,
        ckpt_dir: str,
        step: int,
        timeout_s: float,
        *,
        rank: int | None = None,
        token: int | None = None,
    ) -> bool:
        """Until `step` of save `token` (or a newer step of it) is committed in `ckpt_dir`;
        False on timeout or when this node failed to persist `rank`'s part of it."""
        storage = self._storage(ckpt_dir)
        cdir = CheckpointDir(ckpt_dir, storage)
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                if self._committed.get(cdir.root, -1) >= step:
                    return True
                if rank is not None and self._failed.get(rank) == step:
                    return False
            if _committed_on_storage(cdir, step, token):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._cond:
                self._cond.wait(min(0.1, left))

    # ------------------------------------------------------------------------ for recovery
    def peek(self, path: str, *, deadline: float) -> Header | None:
        """The segment's complete step, waiting (until `deadline`) for a live writer."""
        while True:
            with self._cond:
                try:
                    seg = self._segment(path)
                except FileNotFoundError:
                    return None
                if path in self._pinned:
                    return seg.header()
                if seg.try_lock(exclusive=False):
                    try:
                        return seg.header()
                    finally:
                        seg.unlock()
            if time.monotonic() >= deadline:
                logger.warning("checkpoint segment_busy path=%s: a writer still holds it", path)
                return None
            time.sleep(0.02)

    def peek_now(self, path: str) -> Header | None:
        """The segment's complete step now, without waiting: None while a writer holds it
        (or there is none); for :mod:`.persist_at`, which must not hold a save up."""
        with self._cond:
            try:
                seg = self._segment(path)
            except FileNotFoundError:
                return None
            if path in self._pinned:
                return seg.header()
            if not seg.try_lock(exclusive=False):
                return None
            try:
                return seg.header()
            finally:
                seg.unlock()

    def is_durable(self, *, rank: int, step: int, token: int) -> bool:
        """Whether this saver made `rank`'s part of save `token` of `step` durable."""
        with self._cond:
            return (rank, step, token) in self._durable

    def newest_committed(self, ckpt_dir: str) -> int | None:
        return CheckpointDir(ckpt_dir, self._storage(ckpt_dir)).newest_step()

    def ckpt_dirs(self) -> list[str]:
        """The checkpoint directories this saver was asked to persist to (no I/O)."""
        with self._cond:
            return sorted(self._wanted)

    def durability(self) -> list[Durability]:
        """Per checkpoint directory this saver persisted to: the newest step it was asked to
        persist against the newest step committed on storage (read there, now)."""
        with self._cond:
            wanted, errors = dict(self._wanted), dict(self._errors)
        out = []
        for ckpt_dir, step in sorted(wanted.items()):
            try:
                newest = self.newest_committed(ckpt_dir)
            except (OSError, CheckpointError) as exc:
                newest, errors[ckpt_dir] = None, errors.get(ckpt_dir) or f"reading it: {exc}"
            durable = -1 if newest is None else newest
            error = errors.get(ckpt_dir, "") if durable < step else ""
            out.append(Durability(ckpt_dir=ckpt_dir, wanted=step, durable=durable, error=error))
        return out


def _committed_on_storage(cdir: CheckpointDir, step: int, token: int | None) -> bool:
    newest = cdir.newest_step()
    if newest is None or newest < step:
        return False
    # The committer writes the record, then dlrover_latest.txt: until the tracker says so too,
    # a reader of the tracker (DLRover's loaders, the user) would not see the step yet.
    tracked = cdir.tracker_step()
    if tracked is None or tracked < step:
        return False
    if token is None:
        return True
    for candidate in (step, newest):
        record = cdir.record(candidate)
        if record is not None and record.token == token:
            return True
    return False
