"""Is this node healthy enough to join a round?  Pure verdicts on what the checks measured.

:mod:`dlrover_hpc.agent.health` measures (free space in /dev/shm, a write+fsync+remove in the
checkpoint directory, the clock's offset from the master, NVML's GPU state, the site's
``--health-check`` program) and hands the readings to these functions; each returns one
:class:`CheckResult`: ``ok``, ``failed`` with the reason, or ``skipped`` with why it could not
run (no checkpoint size known yet, no GPUs, no ``nvidia-ml-py``).  Nothing here does I/O, so the
tests call every rule with a table of readings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from enum import StrEnum

#: The checkpoint directory's write+fsync+remove must take less than this (seconds).
FSYNC_BOUND_S = 2.0
#: The clock may be this far from the master's (seconds), less half the round trip's
#: uncertainty: beyond it, a node's timestamps (events, step times, deadlines) mislead.
CLOCK_BOUND_S = 5.0
#: Every built-in check together stays within this per node (the storage check's own wait
#: included): a hung file system costs this, not the job's start.
BUILTIN_BUDGET_S = 5.0


class Status(StrEnum):
    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"


class Check(StrEnum):
    """The checks, by the name that ``node_unhealthy.check`` carries."""

    SHM = "shm"
    STORAGE = "storage"
    CLOCK = "clock"
    GPU = "gpu"
    PROGRAM = "program"  # --health-check


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
    check: Check
    status: Status
    reason: str = ""  # why it failed, or why it was skipped
    ms: float = 0.0  # what the check cost

    def line(self) -> str:
        """``shm=ok(0.1ms)``, ``gpu=skipped(no GPUs)``: the agent's one log line per node."""
        why = f"{self.reason}, " if self.reason and self.status is not Status.OK else ""
        return f"{self.check}={self.status}({why}{self.ms:.1f}ms)"


def ok(check: Check) -> CheckResult:
    return CheckResult(check=check, status=Status.OK)


def failed(check: Check, reason: str) -> CheckResult:
    return CheckResult(check=check, status=Status.FAILED, reason=reason)


def skipped(check: Check, reason: str) -> CheckResult:
    return CheckResult(check=check, status=Status.SKIPPED, reason=reason)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def shm(
    *,
    path: str,
    free_bytes: int | None,
    checkpoint_bytes: int,
    resident_bytes: int = 0,
    error: str = "",
) -> CheckResult:
    """Room in ``path`` for the node's checkpoint: its saves need ``checkpoint_bytes`` there
    (both buffers of every rank), of which ``resident_bytes`` are already allocated (its
    segments of a previous round); 0 before the first save: nothing is known to be needed."""
    if error:
        return failed(Check.SHM, f"{path}: {error}")
    if checkpoint_bytes <= 0:
        return skipped(Check.SHM, "no checkpoint size known yet")
    need = max(0, checkpoint_bytes - resident_bytes)
    if free_bytes is None or free_bytes < need:
        free = "unknown" if free_bytes is None else _size(free_bytes)
        return failed(
            Check.SHM,
            f"{path} has {free} free, the checkpoint needs {_size(need)} more "
            f"({_size(checkpoint_bytes)} in all); free /dev/shm (stale segments of ended jobs) "
            "or give the job more memory",
        )
    return ok(Check.SHM)


def storage(
    *, directory: str, fsync_s: float | None, error: str = "", bound_s: float = FSYNC_BOUND_S
) -> CheckResult:
    """The checkpoint ``directory`` took ``fsync_s`` to write, fsync and remove a small file
    (None: it did not finish within ``bound_s``); ``error``: what the file system refused."""
    if not directory:
        return skipped(Check.STORAGE, "no checkpoint directory known yet")
    if error:
        return failed(Check.STORAGE, f"checkpoint directory {directory} is not writable: {error}")
    if fsync_s is None or fsync_s > bound_s:
        took = "did not finish" if fsync_s is None else f"took {fsync_s:.2f} s"
        return failed(
            Check.STORAGE,
            f"checkpoint directory {directory}: a small write+fsync {took}, over the "
            f"{bound_s:g} s bound (a slow or hung file system)",
        )
    return ok(Check.STORAGE)


def clock(
    *,
    master_time: float | None,
    sent: float,
    received: float,
    bound_s: float = CLOCK_BOUND_S,
    why_unknown: str = "",
) -> CheckResult:
    """The master's wall clock read once between ``sent`` and ``received`` (this node's wall
    clock): the offset is the master's reading less the midpoint, known to within half the
    round trip, so only what is certainly beyond ``bound_s`` fails."""
    if master_time is None:
        return skipped(Check.CLOCK, why_unknown or "the master did not say its time")
    rtt = max(0.0, received - sent)
    offset = master_time - (sent + received) / 2
    if abs(offset) - rtt / 2 > bound_s:
        ahead = "behind" if offset > 0 else "ahead of"
        return failed(
            Check.CLOCK,
            f"clock is {abs(offset):.1f} s {ahead} the master's (bound {bound_s:g} s, "
            f"round trip {rtt * 1000:.0f} ms); fix the node's time sync (chrony/ntpd)",
        )
    return ok(Check.CLOCK)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    """One device as NVML reports it."""

    index: int
    uncorrected_ecc: int = 0  # volatile uncorrectable ECC errors since the driver loaded
    retired_pending: bool = False  # a retired page waits for a reset (pre-Ampere)
    remap_failed: bool = False  # a row remap failed (Ampere and later)
    remap_pending: bool = False  # a remapped row waits for a reset
    xids: tuple[int, ...] = ()  # critical XID events seen during the check


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GpuFacts:
    gpus: tuple[Gpu, ...]


def gpu(facts: GpuFacts | None, *, expected: int, why_unknown: str = "") -> CheckResult:
    """NVML's view of the node's GPUs: at least ``expected`` devices (0: any number), none with
    an uncorrectable ECC error, a pending page retirement or row remap, or a critical XID."""
    if facts is None:
        return skipped(Check.GPU, why_unknown or "no NVML")
    if not facts.gpus:
        return skipped(Check.GPU, "no GPUs")
    if expected and len(facts.gpus) < expected:
        return failed(
            Check.GPU, f"{len(facts.gpus)} GPU(s) found, the job expects {expected} on each node"
        )
    for g in facts.gpus:
        why = [
            *([f"{g.uncorrected_ecc} uncorrectable ECC error(s)"] if g.uncorrected_ecc else []),
            *(["a retired page pending a reset"] if g.retired_pending else []),
            *(["a failed row remap"] if g.remap_failed else []),
            *(["a row remap pending a reset"] if g.remap_pending else []),
            *([f"XID {', '.join(map(str, g.xids))}"] if g.xids else []),
        ]
        if why:
            return failed(Check.GPU, f"GPU {g.index}: {'; '.join(why)}")
    return ok(Check.GPU)


def first_line(*outputs: str) -> str:
    """The first non-empty line of the first output that has one (NHC's convention: the
    reason is the first line it prints)."""
    for text in outputs:
        for line in text.splitlines():
            if line.strip():
                return line.strip()[:300]
    return ""


def program(
    *,
    argv: Sequence[str],
    returncode: int | None,
    stdout: str = "",
    stderr: str = "",
    timeout_s: float = 0.0,
    error: str = "",
) -> CheckResult:
    """The site's program exited with ``returncode`` (None: still running at ``timeout_s``,
    and killed).  0 is healthy; else the first line of its output is the reason."""
    name = argv[0] if argv else "?"
    if error:
        return failed(Check.PROGRAM, f"{name}: {error}")
    if returncode is None:
        return failed(Check.PROGRAM, f"{name} did not finish within {timeout_s:g} s")
    if returncode == 0:
        return ok(Check.PROGRAM)
    how = f"killed by signal {-returncode}" if returncode < 0 else f"exit {returncode}"
    reason = first_line(stdout, stderr) or f"{name}: {how}, no output"
    return failed(Check.PROGRAM, reason)


def verdict(results: Iterable[CheckResult]) -> CheckResult | None:
    """The first failed check (the node is unhealthy), or None (healthy)."""
    return next((r for r in results if r.status is Status.FAILED), None)
