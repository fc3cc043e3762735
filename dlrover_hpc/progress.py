"""Training progress signals, for hang and straggler detection (issue 13).

``dlrover_hpc.progress.step(n)`` tells the node's agent that this rank finished step ``n``
(no argument: one more step).  Scripts need not call it: under ``dlrover-run`` every optimizer
step and every flash-checkpoint save reports progress already.  Outside ``dlrover-run`` it does
nothing.

Each rank owns one small record in node-local memory (``$DLROVER_HPC_PROGRESS_FILE``, in
``/dev/shm``), rewritten in place with one ``pwrite``: the step, the wall time, the seconds the
step spent in the model's forward (from the module hooks, 0 when unknown), the process id and
how many times progress was reported.  The agent reads it; nothing blocks training.

The agent writes into the same record when the job must end at a step boundary (a time limit
or a preemption, :func:`request_stop`): the step to stop at and the wall-clock deadline.  The
flash checkpointer reads it at every save (:func:`stop_requested`, one ``pread``): the first
save at or after that step is persisted, and the rank exits once it is committed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import struct
import time

PATH_ENV = "DLROVER_HPC_PROGRESS_FILE"
_RECORD = struct.Struct("<qddqq")  # step, time, forward_s, pid, count
_STOP = struct.Struct("<qd")  # the step to stop at, deadline (wall clock); written by the agent
_STOP_AT = 64  # its offset in the record, after the worker's part
_STOPPED = struct.Struct("<q")  # 1 + the step a rank stopped at for the notice (0: it did not)
_STOPPED_AT = 80


@dataclasses.dataclass(frozen=True, slots=True)
class Progress:
    step: int
    time: float  # wall clock of the newest report
    forward_s: float  # seconds in the model's forward during that step (0: unknown)
    pid: int  # the training process (a zygote's worker is not the agent's child)
    count: int  # reports so far


@dataclasses.dataclass(frozen=True, slots=True)
class StopNotice:
    """The job ends at the first checkpoint save at or after ``step``, by ``deadline``."""

    step: int
    deadline: float


class _Reporter:
    def __init__(self) -> None:
        self.fd = -1
        self.path = ""
        self.step = 0
        self.count = 0

    def write(self, step: int, forward_s: float) -> None:
        path = os.environ.get(PATH_ENV, "")
        if not path:
            return
        if path != self.path or os.getpid() != self._pid:  # first call, or a forked child
            self._open(path)
        self.step, self.count = step, self.count + 1
        record = _RECORD.pack(step, time.time(), forward_s, os.getpid(), self.count)
        with contextlib.suppress(OSError):  # progress must never break training
            os.pwrite(self.fd, record, 0)

    def stop(self) -> StopNotice | None:
        path = os.environ.get(PATH_ENV, "")
        if not path:
            return None
        if path != self.path or os.getpid() != self._pid:
            try:
                self._open(path)
            except OSError:
                return None
        try:
            data = os.pread(self.fd, _STOP.size, _STOP_AT)
        except OSError:
            return None
        if len(data) < _STOP.size:
            return None
        step, deadline = _STOP.unpack(data)
        return StopNotice(step, deadline) if deadline > 0 else None

    def stopped(self, step: int) -> None:
        if self.stop() is not None:  # opened the record
            with contextlib.suppress(OSError):
                os.pwrite(self.fd, _STOPPED.pack(step + 1), _STOPPED_AT)

    def _open(self, path: str) -> None:
        if self.fd >= 0 and self._pid == os.getpid():
            os.close(self.fd)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.path, self._pid = path, os.getpid()

    _pid = -1


_reporter = _Reporter()


def step(n: int | None = None, *, forward_s: float = 0.0) -> None:
    """This rank finished step ``n`` (default: the step after the last one reported)."""
    _reporter.write(_reporter.step + 1 if n is None else int(n), forward_s)


def current() -> int:
    """The newest step this process reported."""
    return _reporter.step


def stop_requested() -> StopNotice | None:
    """The agent's request to end at a step boundary (time limit, preemption), or None.
    Scripts that save with their own code may poll it and save, then exit, at ``step``."""
    return _reporter.stop()


def mark_stopped(step: int) -> None:
    """This rank ends at ``step`` because of the stop notice (not because training is over):
    the agent tells the master, which then continues the job."""
    _reporter.stopped(step)


def stopped_at(path: str | os.PathLike[str]) -> int | None:
    """The step the rank whose record is at ``path`` stopped at for the notice, or None."""
    try:
        with open(path, "rb") as f:
            f.seek(_STOPPED_AT)
            data = f.read(_STOPPED.size)
    except OSError:
        return None
    if len(data) < _STOPPED.size:
        return None
    (value,) = _STOPPED.unpack(data)
    return value - 1 if value > 0 else None


def request_stop(path: str | os.PathLike[str], notice: StopNotice) -> None:
    """The agent's side: ask the rank whose record is at ``path`` to stop (creates it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.pwrite(fd, _STOP.pack(notice.step, notice.deadline), _STOP_AT)
    finally:
        os.close(fd)


def read(path: str | os.PathLike[str]) -> Progress | None:
    """The record at ``path``; None while the rank has reported nothing."""
    try:
        with open(path, "rb") as f:
            data = f.read(_RECORD.size)
    except OSError:
        return None
    if len(data) < _RECORD.size:
        return None
    record = Progress(*_RECORD.unpack(data))
    return record if record.count > 0 else None  # only a stop request written yet
