"""Training progress signals, for hang and straggler detection (issue 13).

``dlrover_hpc.progress.step(n)`` tells the node's agent that this rank finished step ``n``
(no argument: one more step).  Scripts need not call it: under ``dlrover-run`` every optimizer
step and every flash-checkpoint save reports progress already.  Outside ``dlrover-run`` it does
nothing.

Each rank owns one small record in node-local memory (``$DLROVER_HPC_PROGRESS_FILE``, in
``/dev/shm``), rewritten in place with one ``pwrite``: the step, the wall time, the seconds the
step spent in the model's forward (from the module hooks, 0 when unknown), the process id and
how many times progress was reported.  The agent reads it; nothing blocks training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import struct
import time

PATH_ENV = "DLROVER_HPC_PROGRESS_FILE"
_RECORD = struct.Struct("<qddqq")  # step, time, forward_s, pid, count


@dataclasses.dataclass(frozen=True, slots=True)
class Progress:
    step: int
    time: float  # wall clock of the newest report
    forward_s: float  # seconds in the model's forward during that step (0: unknown)
    pid: int  # the training process (a zygote's worker is not the agent's child)
    count: int  # reports so far


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


def read(path: str | os.PathLike[str]) -> Progress | None:
    """The record at ``path``; None while the rank has reported nothing."""
    try:
        with open(path, "rb") as f:
            data = f.read(_RECORD.size)
    except OSError:
        return None
    if len(data) < _RECORD.size:
        return None
    return Progress(*_RECORD.unpack(data))
