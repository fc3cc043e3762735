"""Training progress signals, for hang and straggler detection (issue 13).

``dlrover_hpc.progress.step(n)`` tells the node's agent that this rank finished step ``n``
(no argument: one more step).  Scripts need not call it: under ``dlrover-run`` every optimizer
step and every flash-checkpoint save reports progress already.  Outside ``dlrover-run`` it does
nothing.

Each rank owns one small record in node-local memory (:data:`environ.PROGRESS_FILE`, in
``/dev/shm``), rewritten in place with one ``pwrite``: the step, the wall time, the seconds the
step spent in the model's forward (from the module hooks, 0 when unknown), the process id, how
many times progress was reported, the p99 of the rank's recent step times, and the newest
step's compute and wait seconds (:mod:`dlrover_hpc.worker.hooks` measures them), and the
newest step the flash checkpointer holds in memory (:func:`saved`).  The agent reads it;
nothing blocks training.

Long phases that are not hangs are *sections* (:func:`section`): a checkpoint save or restore,
an evaluation, a data loader's first batch, or anything a script marks.  The innermost open
section is written beside the record (its name, since when, and its own bound); the master
gives it that bound instead of the one it learned from the step times, and steps that overlap
a section are left out of those.

The agent writes into the same record when the job must end at a step boundary (a time limit
or a preemption, :func:`request_stop`): the step to stop at and the wall-clock deadline.  The
flash checkpointer reads it at every save (:func:`stop_requested`, one ``pread``): the first
save at or after that step is persisted, and the rank exits once it is committed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

from dlrover_hpc import environ

P = ParamSpec("P")
R = TypeVar("R")

PATH_ENV = environ.PROGRESS_FILE
_RECORD = struct.Struct("<qddqqddd")  # step, time, forward_s, pid, count, p99_s, compute, wait
_STOP = struct.Struct("<qd")  # the step to stop at, deadline (wall clock); written by the agent
_STOP_AT = 64  # its offset in the record, after the worker's part
_STOPPED = struct.Struct("<q")  # 1 + the step a rank stopped at for the notice (0: it did not)
_STOPPED_AT = 80
_SECTION = struct.Struct("<24sdd")  # name (empty: none), since (wall clock), bound_s (0: default)
_SECTION_AT = 96
_SAVED = struct.Struct("<q")  # 1 + the newest step the rank saved to memory (0: none yet)
_SAVED_AT = 136
#: The rank's timed steps (past the warm-up, overlapping no section) and the sums of their
#: compute and wait seconds: the master takes the means over every step between two
#: heartbeats, not the one step a heartbeat happens to see (fail-slow, issue 50)
_TIMED = struct.Struct("<qdd")
_TIMED_AT = 144

#: Step times kept for the p99; the first steps of a process (warm-up) are not among them.
STEP_WINDOW, WARMUP_STEPS, MIN_STEPS = 100, 2, 5


@dataclasses.dataclass(frozen=True, slots=True)
class Progress:
    step: int
    time: float  # wall clock of the newest report
    forward_s: float  # seconds in the model's forward during that step (0: unknown)
    pid: int  # the training process (a zygote's worker is not the agent's child)
    count: int  # reports so far
    p99_s: float = 0.0  # p99 of the recent step times, sections left out (0: too few yet)
    compute_s: float = 0.0  # the newest step's own work: data, forward, backward, optimizer
    wait_s: float = 0.0  # the newest step's wait for its peers (the gradients' all-reduce)


@dataclasses.dataclass(frozen=True, slots=True)
class Section:
    """A long phase a rank is in: ``name``, since ``since`` (wall clock), bounded by
    ``bound_s`` (0: the master's default for that name)."""

    name: str
    since: float
    bound_s: float = 0.0


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
        self._last_at = 0.0  # monotonic: the newest step's end
        self._steps_seen = 0
        self._times: deque[float] = deque(maxlen=STEP_WINDOW)
        self._p99 = 0.0
        self._sectioned = False  # a section was open since the newest step
        self._sections: list[tuple[int, str, float, float]] = []  # (token, name, since, bound)
        self._tokens = 0
        self._since_sort = 0
        self._timed = (0, 0.0, 0.0)  # steps, compute and wait seconds (see _TIMED)
        self._lock = threading.Lock()  # sections may open and close on other threads
        self._forked = False  # a child forked after the rank opened its record (data loader)
        self.clock = time.monotonic  # tests set their own

    def after_fork_in_child(self) -> None:
        """A data-loader worker (or any child) of a rank must not write the rank's sections."""
        if self._pid != -1:
            self._forked = True
            self._sections = []
            self._lock = threading.Lock()

    def adopt(self) -> None:
        """This process owns its record after all (a worker forked from the zygote)."""
        self._forked = False

    def write(
        self, step: int, forward_s: float, compute_s: float = 0.0, wait_s: float = 0.0
    ) -> None:
        if not self._opened():  # progress must never break training
            return
        now = self.clock()
        timed = False
        if step == self.step + 1 and self._last_at:
            self._steps_seen += 1
            if self._steps_seen > WARMUP_STEPS and not self._sectioned:
                if compute_s > 0:
                    n, compute, wait = self._timed
                    self._timed, timed = (n + 1, compute + compute_s, wait + wait_s), True
                self._times.append(now - self._last_at)
                self._since_sort += 1
                if len(self._times) >= MIN_STEPS and (self._since_sort >= 10 or not self._p99):
                    self._since_sort = 0
                    ordered = sorted(self._times)
                    self._p99 = ordered[int(0.99 * (len(ordered) - 1))]
        self._last_at, self._sectioned = now, bool(self._sections)
        self.step, self.count = step, self.count + 1
        record = _RECORD.pack(
            step, time.time(), forward_s, os.getpid(), self.count, self._p99, compute_s, wait_s
        )
        with contextlib.suppress(OSError):  # progress must never break training
            os.pwrite(self.fd, record, 0)
            if timed:
                os.pwrite(self.fd, _TIMED.pack(*self._timed), _TIMED_AT)

    def enter(self, name: str, bound_s: float) -> int:
        with self._lock:
            self._tokens += 1
            self._sections.append((self._tokens, name, time.time(), bound_s))
            self._sectioned = True
            self._write_section()
            return self._tokens

    def leave(self, token: int) -> None:
        with self._lock:
            kept = [s for s in self._sections if s[0] != token]
            if len(kept) != len(self._sections):
                self._sections = kept
                self._write_section()

    def open_sections(self) -> list[str]:
        return [name for _, name, _, _ in self._sections]

    def _write_section(self) -> None:
        if self._forked or not self._opened():
            return
        if self._sections:
            _, name, since, bound = self._sections[-1]
            data = _SECTION.pack(name.encode()[: _SECTION.size - 16], since, bound)
        else:
            data = _SECTION.pack(b"", 0.0, 0.0)
        with contextlib.suppress(OSError):
            os.pwrite(self.fd, data, _SECTION_AT)

    def stop(self) -> StopNotice | None:
        if not self._opened():
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

    def saved(self, step: int) -> None:
        if self._forked or not self._opened():
            return
        with contextlib.suppress(OSError):  # progress must never break training
            os.pwrite(self.fd, _SAVED.pack(step + 1), _SAVED_AT)

    def _opened(self) -> bool:
        """The record is open in this process: opened on the first call, and again in a forked
        child; False outside dlrover-run or when it cannot be opened."""
        path = os.environ.get(PATH_ENV, "")
        if not path:
            return False
        if path != self.path or os.getpid() != self._pid:
            try:
                self._open(path)
            except OSError:
                return False
        return True

    def _open(self, path: str) -> None:
        if self.fd >= 0 and self._pid == os.getpid():
            os.close(self.fd)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.path, self._pid = path, os.getpid()

    _pid = -1


_reporter = _Reporter()
os.register_at_fork(after_in_child=_reporter.after_fork_in_child)


def step(
    n: int | None = None, *, forward_s: float = 0.0, compute_s: float = 0.0, wait_s: float = 0.0
) -> None:
    """This rank finished step ``n`` (default: the step after the last one reported)."""
    _reporter.write(_reporter.step + 1 if n is None else int(n), forward_s, compute_s, wait_s)


@contextlib.contextmanager
def section(name: str, *, timeout_s: float = 0.0) -> Iterator[None]:
    """Marks a long phase that is not a hang, e.g. ``with progress.section("eval"): ...``.

    While it is open the rank is held to the section's own bound: ``timeout_s`` when given,
    else the master's default for ``name`` (``checkpoint``, ``eval``, ``data``, ``warmup``;
    any other name gets the eval bound), and its use of the CPU counts as progress.  Steps
    that overlap a section do not count towards the learned step time.  Nests; does nothing
    outside ``dlrover-run``."""
    _check_bound(name, timeout_s)
    token = _reporter.enter(name, float(timeout_s))
    try:
        yield
    finally:
        _reporter.leave(token)


def sectioned(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator: the function runs in :func:`section` ``name``."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            with section(name):
                return fn(*args, **kwargs)

        return inner

    return wrap


def enter_section(name: str, *, timeout_s: float = 0.0) -> int:
    """:func:`section` for phases that do not fit a ``with`` block; returns a token for
    :func:`leave_section`."""
    _check_bound(name, timeout_s)
    return _reporter.enter(name, float(timeout_s))


def _check_bound(name: str, timeout_s: float) -> None:
    if not (timeout_s >= 0 and timeout_s != float("inf")):
        raise ValueError(
            f"section {name!r}: timeout_s={timeout_s!r} must be 0 (default) or seconds"
        )


def adopt() -> None:
    """Called by a worker forked from the zygote: the record is this process's own."""
    _reporter.adopt()


def leave_section(token: int) -> None:
    _reporter.leave(token)


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


def saved(step: int) -> None:
    """This rank holds ``step`` in memory now (a flash-checkpoint save): the master swaps a
    straggler's node once every rank saved a step after it was found."""
    _reporter.saved(int(step))


def saved_at(path: str | os.PathLike[str]) -> int | None:
    """The newest step the rank whose record is at ``path`` saved to memory, or None."""
    fields = _read_at(path, _SAVED, _SAVED_AT)
    if fields is None:
        return None
    (value,) = fields
    return value - 1 if value > 0 else None


def timed_at(path: str | os.PathLike[str]) -> tuple[int, float, float]:
    """The rank's timed steps and the sums of their compute and wait seconds (see
    :data:`_TIMED`); zeros while there are none."""
    fields = _read_at(path, _TIMED, _TIMED_AT)
    return (0, 0.0, 0.0) if fields is None else fields


def stopped_at(path: str | os.PathLike[str]) -> int | None:
    """The step the rank whose record is at ``path`` stopped at for the notice, or None."""
    fields = _read_at(path, _STOPPED, _STOPPED_AT)
    if fields is None:
        return None
    (value,) = fields
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
    fields = _read_at(path, _RECORD, 0)
    if fields is None:
        return None
    record = Progress(*fields)
    return record if record.count > 0 else None  # only a stop request written yet


def read_section(path: str | os.PathLike[str]) -> Section | None:
    """The innermost section the rank whose record is at ``path`` is in, or None."""
    fields = _read_at(path, _SECTION, _SECTION_AT)
    if fields is None:
        return None
    raw, since, bound = fields
    name = raw.rstrip(b"\0").decode(errors="replace")
    return Section(name, since, bound) if name else None


def _read_at(path: str | os.PathLike[str], fmt: struct.Struct, offset: int) -> tuple | None:
    """``fmt``'s fields at ``offset`` of the record at ``path``; None when it is missing or
    not written that far yet."""
    try:
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), fmt.size, offset)
    except OSError:
        return None
    return fmt.unpack(data) if len(data) == fmt.size else None
