"""Checkpoint storage through fsspec: temporary name, fsync, rename; parallel writes.

Local paths (and NFS/Lustre mounts, which are paths) take a fast path with `os.pwrite` from
several threads into one preallocated temporary file, then fsync, rename and an fsync of the
directory.  Other fsspec file systems stream sequentially to a temporary name and move it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import mmap
import os
import re
import socket
import struct
import threading
import uuid
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dlrover_hpc.checkpoint.api import TMP_MARK, FaultHook
from dlrover_hpc.checkpoint.env import safe_component
from dlrover_hpc.checkpoint.formats.zip_archive import crc32
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20
_Range = tuple[int, int, list[int]]  # data start, length, offsets of the CRC fields


def _no_fault(point: str) -> None:
    return None


_HOST = safe_component(socket.gethostname(), limit=32)
_TMP = re.compile(re.escape(TMP_MARK) + r"(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-[0-9a-f]+$")


def tmp_name(path: str) -> str:
    """`.<name>.dlrover-tmp-<host>-<pid>-<random>` beside `path`."""
    head, tail = os.path.split(path.rstrip("/"))
    return os.path.join(head, f".{tail}{TMP_MARK}{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def stale_tmp(name: str) -> bool:
    """True for a temporary file left by a dead process of this host (never another host's:
    its pids mean nothing here)."""
    m = _TMP.search(name)
    if m is None or m["host"] != _HOST:
        return False
    try:
        os.kill(int(m["pid"]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Storage:
    """Storage operations on one fsspec file system (the one of the checkpoint directory)."""

    def __init__(self, url: str, *, threads: int = 4, drop_cache: bool = True) -> None:
        fs, _ = fsspec.core.url_to_fs(url)
        self.fs = fs
        self.local = isinstance(fs, LocalFileSystem)
        self.threads = max(1, threads)
        self.drop_cache = drop_cache

    def path(self, url: str) -> str:
        """The file system path of `url` (a plain path or a URL of the same file system)."""
        return str(fsspec.core.url_to_fs(url)[1]) if "://" in url else url

    # ------------------------------------------------------------------------------ writing
    def write_image(
        self,
        path: str,
        image: memoryview,
        crc_ranges: Sequence[Sequence[Any]],
        *,
        fault: FaultHook = _no_fault,
    ) -> None:
        """Writes `image` as `path` atomically; CRC-32 of each [start, length, [fields]]
        range is computed on the way and written into its fields (file offsets)."""
        ranges = sorted((int(r[0]), int(r[1]), [int(x) for x in r[2]]) for r in crc_ranges)
        if self.local:
            self._write_local(path, image, ranges, fault)
        else:
            self._write_remote(path, image, ranges, fault)

    def _write_local(
        self, path: str, image: memoryview, ranges: list[_Range], fault: FaultHook
    ) -> None:
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        tmp = tmp_name(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                if len(image):
                    os.posix_fallocate(fd, 0, len(image))
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
            fault("persist:tmp_created")
            groups = _partition(_units(len(image), ranges), self.threads)
            crcs: dict[int, int] = {}
            run_parallel(
                [functools.partial(_write_group, fd, image, g, crcs, fault) for g in groups]
            )
            fault("persist:written")
            for index, (_, _, fields) in enumerate(ranges):
                for at in fields:
                    os.pwrite(fd, struct.pack("<I", crcs[index]), at)
            os.fsync(fd)
            fault("persist:fsynced")
            if self.drop_cache:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        try:
            os.rename(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fault("persist:renamed")
        fsync_dir(directory)

    def _write_remote(
        self, path: str, image: memoryview, ranges: list[_Range], fault: FaultHook
    ) -> None:
        patches: dict[int, bytes] = {}
        for start, length, fields in ranges:
            value = struct.pack("<I", crc32(image[start : start + length]))
            for at in fields:
                patches[at] = value
        tmp = tmp_name(path)
        parent = os.path.dirname(path)
        if parent:
            self.fs.makedirs(parent, exist_ok=True)
        try:
            with self.fs.open(tmp, "wb") as f:
                fault("persist:tmp_created")
                for start in range(0, len(image), _CHUNK):
                    chunk = image[start : start + _CHUNK]
                    hits = [at for at in patches if start <= at < start + len(chunk)]
                    if hits:
                        buf = bytearray(chunk)
                        for at in hits:
                            buf[at - start : at - start + 4] = patches[at]
                        f.write(buf)
                    else:
                        f.write(chunk)
            fault("persist:written")
            self.fs.mv(tmp, path)
            fault("persist:renamed")
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise

    def write_bytes(self, path: str, data: bytes, *, fault: FaultHook = _no_fault) -> None:
        """A small file replaced atomically (temporary name, fsync, rename, fsync dir)."""
        self.write_image(path, memoryview(data), [], fault=fault)

    def close(self) -> None:
        """Nothing to release; kept so owners can treat storages uniformly."""

    # ------------------------------------------------------------------------------ reading
    def read_bytes(self, path: str) -> bytes | None:
        try:
            if self.local:
                with open(path, "rb") as f:
                    return f.read()
            return bytes(self.fs.cat_file(path))
        except FileNotFoundError:
            return None

    def map_file(self, path: str) -> Any:
        """The file's bytes as a buffer: a private mmap for local files, else in memory."""
        if not self.local:
            return bytearray(self.fs.cat_file(path))
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return bytearray()
            return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def listdir(self, path: str) -> list[str]:
        try:
            if self.local:
                return sorted(os.listdir(path))
            return sorted(os.path.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def sweep_tmp(self, directory: str) -> list[str]:
        """Removes temporary files that crashed writers of this host left in `directory`."""
        removed = []
        for name in self.listdir(directory):
            if stale_tmp(name):
                self.remove(f"{directory.rstrip('/')}/{name}")
                removed.append(name)
        if removed:
            logger.info("checkpoint stale_tmp_removed dir=%s count=%d", directory, len(removed))
        return removed

    def remove(self, path: str) -> None:
        """Removes a file or a directory tree; a missing path is not an error."""
        try:
            if self.fs.isdir(path):
                self.fs.rm(path, recursive=True)
            else:
                self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def remove_empty_dir(self, path: str) -> None:
        """Removes the directory `path` if it is empty (local file systems; object stores
        have no empty directories)."""
        if not self.local:
            return
        with contextlib.suppress(OSError):  # not empty, gone, or not a directory: leave it
            os.rmdir(path)


def run_parallel(tasks: Sequence[Callable[[], None]]) -> None:
    """Runs the tasks on fresh threads (the first in the caller's) and re-raises a failure.

    Plain threads, not an executor: the in-process saver also persists while the interpreter
    exits, when executors refuse new work.
    """
    errors: list[BaseException] = []

    def guard(task: Callable[[], None]) -> None:
        try:
            task()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guard, args=(t,), name="ckpt-io") for t in tasks[1:]]
    for thread in threads:
        thread.start()
    if tasks:
        guard(tasks[0])
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _units(size: int, ranges: list[_Range]) -> list[tuple[int, int, int]]:
    """(start, end, crc index or -1) covering [0, size) in order."""
    units: list[tuple[int, int, int]] = []
    pos = 0
    for index, (start, length, _) in enumerate(ranges):
        if start < pos or start + length > size:
            raise CheckpointError(f"CRC range [{start}, {start + length}) outside the image")
        if start > pos:
            units.append((pos, start, -1))
        units.append((start, start + length, index))
        pos = start + length
    if pos < size:
        units.append((pos, size, -1))
    return units


def _partition(units: list[tuple[int, int, int]], n: int) -> list[list[tuple[int, int, int]]]:
    total = sum(u[1] - u[0] for u in units) or 1
    groups: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    acc, index = 0, 0
    for unit in units:
        if acc >= total * (index + 1) / n and index < n - 1:
            index += 1
        groups[index].append(unit)
        acc += unit[1] - unit[0]
    return [g for g in groups if g]


def _write_group(
    fd: int,
    image: memoryview,
    group: list[tuple[int, int, int]],
    crcs: dict[int, int],
    fault: FaultHook,
) -> None:
    for start, end, index in group:
        value = 0
        for pos in range(start, end, _CHUNK):
            chunk = image[pos : min(end, pos + _CHUNK)]
            if index >= 0:
                value = zlib.crc32(chunk, value)
            written = 0
            while written < len(chunk):
                written += os.pwrite(fd, chunk[written:], pos + written)
            fault("persist:chunk")
        if index >= 0:
            crcs[index] = value
