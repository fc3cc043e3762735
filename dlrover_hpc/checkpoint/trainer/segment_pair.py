"""This rank's two shared-memory segments, and which one a save writes.

A save takes a buffer under LOCK_EX: the one not holding the newest step when the saver has
not pinned it, else the other one.  When the saver pins both (one persisting, one queued behind
it: storage is slower than the saves, or hangs), the save asks the saver to release the queued
one and takes it: that step is superseded by this newer one, and training never waits for
storage.  Only a saver that cannot release (an older agent) makes a save wait, logged and
reported as blocking time.  Segments stay mapped for
the life of the process; the second one is created and pre-faulted in a background thread
after the first save.  A segment whose file was removed (a replaced node, a cleanup) is
dropped, so the next save creates it again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import torch

from dlrover_hpc.checkpoint.saver.segments import Segment, needed_size
from dlrover_hpc.checkpoint.trainer.gpu_staging import HostPinner
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)


class SegmentPair:
    """The double buffer of one rank: acquire, finish, prepare the second, warm them up."""

    def __init__(
        self,
        path_of: Callable[[int], str],
        pinner: HostPinner,
        *,
        max_wait_s: float,
        release: Callable[[str], bool] | None = None,
    ) -> None:
        self._path_of = path_of
        self._pinner = pinner
        #: asks the saver to unpin a buffer whose step waits in its queue (True: it did)
        self._release = release
        #: longest a save waits for the saver to release a buffer before it is skipped
        self.max_wait_s = max_wait_s
        self.segments: list[Segment | None] = [None, None]
        #: the buffer holding the newest step this process wrote or found
        self.newest: int | None = None
        #: creates and pre-faults the second buffer after the first save (acquire waits for it)
        self._prepare: threading.Thread | None = None
        #: re-populates page tables of segments mapped after a restart (nobody waits for it)
        self._warm: threading.Thread | None = None

    def segment(self, buffer: int) -> Segment:
        """This rank's segment `buffer`, created (empty) if it does not exist."""
        seg = self.segments[buffer]
        if seg is None:
            seg = Segment(self._path_of(buffer), writable=True)
            self.segments[buffer] = seg
        return seg

    def existing(self, buffer: int) -> Segment | None:
        """This rank's segment `buffer` if its file exists (remapped if it grew); a mapping
        whose file was removed or replaced is dropped, so no save writes into it again."""
        self.join_prepare()
        try:
            inode = os.stat(self._path_of(buffer)).st_ino
        except FileNotFoundError:
            self._drop(buffer)
            return None
        seg = self.segments[buffer]
        if seg is not None and seg.inode != inode:
            self._drop(buffer)
        seg = self.segment(buffer)
        seg.remap_if_grown()
        return seg

    def _drop(self, buffer: int) -> None:
        seg = self.segments[buffer]
        if seg is None:
            return
        if self._warm is not None:  # it may be pinning this mapping
            self._warm.join()
            self._warm = None
        logger.info("checkpoint segment_gone path=%s: the next save creates it again", seg.path)
        seg.close()
        self.segments[buffer] = None
        if self.newest == buffer:
            self.newest = None

    # ------------------------------------------------------------------------ writing
    def acquire(
        self, image_len: int, meta_len: int, device: torch.device | None = None
    ) -> tuple[Segment, float]:
        """A buffer locked for writing and large enough (page-locked for `device`, a GPU);
        returns it and the seconds waited."""
        self.join_prepare()
        if device is not None and self._warm is not None:  # it may be pinning these segments
            self._warm.join()
            self._warm = None
        order = [0, 1] if self.newest is None else [1 - self.newest, self.newest]
        size = needed_size(image_len, meta_len)
        t0 = time.perf_counter()
        released = self._release is None
        while True:
            for buffer in order:
                seg = self.segment(buffer)
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
                        self._pinner.pin(seg, device)
                    return seg, waited
            if not released:  # both pinned: one persisting, one queued behind it
                released = self._release_queued(order)
                continue
            if time.perf_counter() - t0 > self.max_wait_s:
                raise CheckpointError(
                    f"both shared-memory buffers stayed pinned by the saver for "
                    f"{self.max_wait_s:.0f} s (is storage hanging?); this save is skipped"
                )
            time.sleep(0.005)  # the saver unpins a buffer when its persist ends

    def _release_queued(self, order: list[int]) -> bool:
        """Both buffers locked by the saver: asks it to let go of the queued one; True once
        asked (the next look takes the released buffer)."""
        assert self._release is not None
        for buffer in order:
            if self._release(self.segment(buffer).path):
                return True
        return True  # neither is queued (both persisting: two savers?); wait as before

    @staticmethod
    def _grow(seg: Segment, size: int) -> None:
        try:
            seg.ensure_size(size)
        except CheckpointError:
            seg.unlock()
            raise

    def finish(self, seg: Segment, *, seq: int, step: int, image_len: int, meta: bytes) -> None:
        seg.finish_write(seq=seq, step=step, image_len=image_len, meta=meta)
        self.newest = self.segments.index(seg)

    # ------------------------------------------------------------------------ background
    def prepare_second(self, size: int, device: torch.device | None) -> None:
        """After the first save: creates and pre-faults (or pins) the other buffer."""
        if self.segments[1] is not None or self._prepare is not None:
            return
        self._prepare = threading.Thread(
            target=self._prepare_other, args=(size, device), name="ckpt-prefault", daemon=True
        )
        self._prepare.start()

    def _prepare_other(self, size: int, device: torch.device | None) -> None:
        try:
            seg = self.segment(1)
            if not seg.try_lock(exclusive=True):
                return
            try:
                seg.ensure_size(size)
            finally:
                seg.unlock()
            self._pinner.warm_up(seg, device)
        except (OSError, CheckpointError) as exc:
            logger.warning("checkpoint second_buffer_failed error=%s", exc)

    def warm_in_background(self, segments: Sequence[Segment], device: torch.device | None) -> None:
        """Pins (for a GPU) or pre-faults `segments` off the training path, unless a warm-up
        is still running."""
        if not segments or (self._warm is not None and self._warm.is_alive()):
            return

        def run() -> None:
            for seg in segments:
                self._pinner.warm_up(seg, device)

        self._warm = threading.Thread(target=run, name="ckpt-warm", daemon=True)
        self._warm.start()

    def join_prepare(self) -> None:
        if self._prepare is not None:
            self._prepare.join()
            self._prepare = None

    def wait_prepared(self) -> None:
        """Until background buffer preparation is done (benchmarks, tests, close)."""
        for thread in (self._prepare, self._warm):
            if thread is not None:
                thread.join()

    def close(self, *, remove: bool) -> None:
        self.wait_prepared()
        for seg in self.segments:
            if seg is None:
                continue
            seg.close()
            if remove:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(seg.path)
