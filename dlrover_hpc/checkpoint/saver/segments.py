"""Shared-memory segments: one file in /dev/shm per saving rank and buffer.

Layout: a 4 KiB header, then the image (the bytes that become the checkpoint file(s)), then a
JSON description ("meta") of the image.  The header holds the step, the state and CRC-32s of
itself and of the meta; the saver adds the data CRCs while persisting.

Concurrency is by `flock` on the segment file, which the kernel drops when a process dies:
the trainer writes under LOCK_EX; the saver holds LOCK_SH from the moment it accepts a persist
request until the step is durable, so a pending step is never overwritten.  A writer that dies
mid-copy leaves state WRITING, which no reader accepts.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import errno
import fcntl
import functools
import json
import logging
import mmap
import os
import re
import struct
import threading
import time
import zlib
from typing import Any, Protocol

from dlrover_hpc.checkpoint.env import BUFFERS
from dlrover_hpc.errors import CheckpointError, SegmentSpaceError

logger = logging.getLogger(__name__)

MAGIC = b"DLRHPCK\x01"
VERSION = 1
HEADER_SIZE = 4096
#: magic version state seq step image_len meta_off meta_len meta_crc head_crc written_at
_HEAD = struct.Struct("<8sIIQqQQQIId")
_STATE_AT = 12
_CRC_SPAN = (16, 56)  # seq .. meta_crc
_HEAD_CRC_AT = 60
MADV_POPULATE_WRITE = 23


class State(enum.IntEnum):
    EMPTY = 0
    WRITING = 1
    COMPLETE = 2


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    """A complete segment's header and meta, as read under a lock."""

    step: int
    seq: int
    image_len: int
    written_at: float
    meta: dict[str, Any]
    #: the bytes of the segment the step covers: header, image and meta
    size: int = 0


def read_header(buf: Any) -> Header | None:
    """The segment's header if it holds a complete, intact step; else None."""
    view = memoryview(buf)
    if len(view) < HEADER_SIZE:
        return None
    magic, version, state, seq, step, image_len, meta_off, meta_len, meta_crc, head_crc, at = (
        _HEAD.unpack_from(view, 0)
    )
    if magic != MAGIC or version != VERSION or state != State.COMPLETE:
        return None
    if zlib.crc32(view[_CRC_SPAN[0] : _CRC_SPAN[1] + 4]) != head_crc:
        return None
    if meta_off + meta_len > len(view) or HEADER_SIZE + image_len > meta_off:
        return None
    raw = view[meta_off : meta_off + meta_len]
    if zlib.crc32(raw) != meta_crc:
        return None
    try:
        meta = json.loads(bytes(raw))
    except ValueError:
        return None
    if meta.get("step") != step:
        return None
    return Header(
        step=step,
        seq=seq,
        image_len=image_len,
        written_at=at,
        meta=meta,
        size=meta_off + meta_len,
    )


def meta_offset(image_len: int) -> int:
    return HEADER_SIZE + (image_len + 63) // 64 * 64


def needed_size(image_len: int, meta_len: int) -> int:
    """Segment size for an image and meta, rounded up to 2 MiB with a little headroom."""
    raw = meta_offset(image_len) + meta_len + max(64 << 10, image_len // 512)
    return (raw + (2 << 20) - 1) // (2 << 20) * (2 << 20)


class Attachment(Protocol):
    """Something bound to a mapping's addresses (a CUDA host registration) that must be
    released before the mapping goes away."""

    def release(self) -> None: ...


class Segment:
    """A segment mapped read-write by its owning trainer, or read-only by anyone else.

    `private` maps a read-only segment copy-on-write, so torch can build views over it;
    `shared_read` maps another process's segment shared and writable at the page level (so
    CUDA can page-lock it without copying every page), though nothing here writes to it.
    """

    def __init__(
        self, path: str, *, writable: bool, private: bool = False, shared_read: bool = False
    ) -> None:
        self.path = path
        self.writable = writable
        self.private = private and not shared_read
        self.shared_read = shared_read
        flags = os.O_RDONLY
        if writable or shared_read:
            flags = os.O_RDWR | (os.O_CREAT if writable else 0)
        self.fd = os.open(path, flags, 0o600)
        self.mm: mmap.mmap | None = None
        self.size = 0
        self.inode = os.fstat(self.fd).st_ino
        self._locked = 0
        #: cached tensor views over `mm` (owned by the engine); dropped before a remap
        self.views: Any = None
        #: a CUDA host registration of `mm` (trainer side); released before any unmap
        self.pin: Attachment | None = None
        self._map(os.fstat(self.fd).st_size)

    def _map(self, size: int) -> None:
        self.views = None
        self.release_pin()
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        self.size = size
        if size:
            access = mmap.ACCESS_WRITE if self.writable or self.shared_read else mmap.ACCESS_READ
            if self.private:
                access = mmap.ACCESS_COPY
            self.mm = mmap.mmap(self.fd, size, access=access)

    # -- locking -------------------------------------------------------------------------------
    def try_lock(self, exclusive: bool) -> bool:
        op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        try:
            fcntl.flock(self.fd, op)
        except BlockingIOError:
            return False
        self._locked = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        return True

    def lock(self, exclusive: bool) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        self._locked = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH

    def unlock(self) -> None:
        if self._locked:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self._locked = 0

    # -- writer side -------------------------------------------------------------------------
    def ensure_size(self, size: int) -> bool:
        """Grows (never shrinks) the segment under LOCK_EX; True if it was remapped.

        Space is reserved with posix_fallocate, so a full /dev/shm is an error here, not a
        SIGBUS in the middle of a copy.
        """
        if size <= self.size:
            return False
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:
            directory = os.path.dirname(self.path)
            free = _free_bytes(directory)
            raise SegmentSpaceError(
                f"cannot reserve {size / 2**30:.2f} GiB for {self.path} "
                f"({os.strerror(exc.errno or errno.EIO)}; {free / 2**30:.2f} GiB free in "
                f"{directory}); each rank that saves needs two such buffers there: enlarge the "
                "tmpfs (docker/podman --shm-size, or mount -o remount,size=...), and under "
                "Slurm ask for --mem that also covers them (shared memory counts against the "
                "job's memory)"
            ) from exc
        self._map(size)
        return True

    def address(self) -> int:
        """The mapping's start address (0 when unmapped or mapped read-only)."""
        if self.mm is None or not (self.writable or self.shared_read or self.private):
            return 0
        anchor = ctypes.c_char.from_buffer(self.mm)
        address = ctypes.addressof(anchor)
        del anchor  # no export held after the call
        return address

    def prefault(self, threads: int = 1) -> None:
        """Populates the page tables for writing, off the training path.

        Through ctypes, which releases the GIL (mmap.madvise holds it for the whole call,
        stalling the training thread); kernels without MADV_POPULATE_WRITE skip it.  With
        `threads` > 1 the range is split: first-touch zeroing of tmpfs pages scales with cores
        (2 GiB: 0.8 s on one thread, 0.5 s on eight, measured on an H100 host).
        """
        if self.mm is None or not (self.writable or self.shared_read):
            return
        address, size = self.address(), self.size
        chunk = max(64 << 20, (size // max(1, threads) + 4095) // 4096 * 4096)
        ranges = [(at, min(chunk, size - at)) for at in range(0, size, chunk)]
        if len(ranges) == 1:
            _populate(address, size, self.path)
            return
        workers = [
            threading.Thread(target=_populate, args=(address + at, n, self.path), daemon=True)
            for at, n in ranges
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def release_pin(self) -> None:
        pin, self.pin = self.pin, None
        if pin is not None:
            pin.release()

    def begin_write(self) -> int:
        assert self.mm is not None
        seq = struct.unpack_from("<Q", self.mm, 16)[0] + 1
        struct.pack_into("<8sIIQ", self.mm, 0, MAGIC, VERSION, State.WRITING, seq)
        return seq

    def finish_write(self, *, seq: int, step: int, image_len: int, meta: bytes) -> None:
        assert self.mm is not None
        off = meta_offset(image_len)
        if off + len(meta) > self.size:
            raise CheckpointError(
                f"checkpoint metadata ({len(meta)} bytes) does not fit in {self.path}"
            )
        self.mm[off : off + len(meta)] = meta
        fields = (MAGIC, VERSION, State.WRITING, seq, step, image_len, off, len(meta))
        struct.pack_into("<8sIIQqQQQI", self.mm, 0, *fields, zlib.crc32(meta))
        head_crc = zlib.crc32(self.mm[_CRC_SPAN[0] : _CRC_SPAN[1] + 4])
        struct.pack_into("<Id", self.mm, _HEAD_CRC_AT, head_crc, time.time())
        struct.pack_into("<I", self.mm, _STATE_AT, State.COMPLETE)

    def invalidate(self) -> None:
        """Marks the segment as holding no step (a failed write leaves no half state)."""
        if self.mm is not None and self.size >= HEADER_SIZE:
            struct.pack_into("<I", self.mm, _STATE_AT, State.WRITING)

    # -- reader side -------------------------------------------------------------------------
    def header(self) -> Header | None:
        return read_header(self.mm) if self.mm is not None else None

    def stale(self) -> bool:
        """True when the file at `path` was replaced or resized since we mapped it."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        return st.st_ino != self.inode or st.st_size != self.size

    def remap_if_grown(self) -> None:
        size = os.fstat(self.fd).st_size
        if size != self.size:
            self._map(size)

    def close(self) -> None:
        self.unlock()
        self.views = None
        self.release_pin()
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a caller still holds views; the GC unmaps it later
                logger.debug("shm close_deferred path=%s", self.path)
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _populate(address: int, size: int, path: str) -> None:
    if _libc().madvise(address, size, MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        logger.debug("shm prefault_unsupported path=%s error=%s", path, os.strerror(err))


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _free_bytes(directory: str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


_NAME = re.compile(r"^(?P<copy>c?)r(?P<rank>\d+)(?:-(?P<tag>[A-Za-z0-9_.]+))?-(?P<buf>[ab])$")
#: a copy being received (`replicas`): never listed as a segment, removed with the job's
COPY_TMP = ".tmp"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SegmentName:
    path: str
    rank: int
    buffer: int
    tag: str
    #: a copy of another node's segment (`replica_count`), named `<prefix>c<its name>`
    copy: bool = False


def copy_name(name: str) -> str:
    """The name on a peer node of a copy of segment `name` (without the prefix)."""
    return f"c{name}"


def list_segments(shm_dir: str, prefix: str, *, copies: bool = False) -> list[SegmentName]:
    """This job's and node's segments in `shm_dir` (names from `env.segment_name`); with
    `copies`, the copies of other nodes' segments kept here instead."""
    found = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    for name in sorted(names):
        if not name.startswith(prefix):
            continue
        m = _NAME.fullmatch(name[len(prefix) :])
        if m and bool(m["copy"]) == copies:
            found.append(
                SegmentName(
                    path=os.path.join(shm_dir, name),
                    rank=int(m["rank"]),
                    buffer=BUFFERS.index(m["buf"]),
                    tag=m["tag"] or "",
                    copy=copies,
                )
            )
    return found


def unlink_segments(shm_dir: str, prefix: str) -> list[str]:
    """Removes this job's segments on this node, the copies of other nodes' and the copies
    still being received."""
    removed = []
    paths = [s.path for s in list_segments(shm_dir, prefix)]
    paths += [s.path for s in list_segments(shm_dir, prefix, copies=True)]
    with contextlib.suppress(FileNotFoundError):
        paths += [
            os.path.join(shm_dir, n)
            for n in os.listdir(shm_dir)
            if n.startswith(prefix + "c") and n.endswith(COPY_TMP)
        ]
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
