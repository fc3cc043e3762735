"""Collectors that gather `FailureEvidence` on a node after a worker failed.

Each collector reads what it can and returns an empty answer when it cannot: a missing file, a
cgroup without memory accounting, or a `dmesg` that needs privileges must never turn a worker
failure into an agent failure. Paths and the command runner are parameters so that tests (and
unusual hosts) can point them elsewhere.

OOM evidence comes from two places: the memory cgroup's `oom_kill` counter (cgroup v2
`memory.events`, v1 `memory.oom_control`; compare a reading taken before the workers started with
one taken after the failure) and the kernel log (`Out of memory: Killed process PID (...)`) where
`dmesg` is readable. Kernel-log lines are narrowed to the failure: only lines after the workers
started (`since_uptime_s`, seconds since boot as in `/proc/uptime`) and, for OOM lines, only the
workers' PIDs; an Xid from last week must not condemn today's node.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Protocol

from dlrover_hpc.diagnosis.evidence import FailureEvidence

logger = logging.getLogger(__name__)

DEFAULT_TAIL_BYTES = 64 * 1024
MAX_ERROR_FILE_BYTES = 1024 * 1024
DMESG_TIMEOUT_S = 5.0
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

_KERNEL_TIME = re.compile(r"^\[\s*(\d+\.\d+)\]")
_OOM_KILLED_PID = re.compile(
    r"(?:Out of memory|Memory cgroup out of memory): Kill(?:ed)? process (\d+)|"
    r"oom-kill:.*?\bpid=(\d+)",
    re.IGNORECASE,
)
_HARDWARE_KERNEL = re.compile(
    r"NVRM: Xid|\[Hardware Error\]|Machine check events logged|EDAC MC\d+|"
    r"fallen off the bus|\bmlx\d_\d+\b.*\b(?:down|error)\b",
    re.IGNORECASE,
)


class CommandRunner(Protocol):
    """Runs argv with a timeout; returns stdout, or None if it could not run or failed."""

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> str | None: ...


def run_quietly(argv: Sequence[str], *, timeout_s: float) -> str | None:
    """The default `CommandRunner`: no shell, no exceptions, None on any failure."""
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as e:
        logger.debug("diagnosis_command_failed argv=%s error=%s", argv[0], e)
        return None
    if done.returncode != 0:
        logger.debug("diagnosis_command_failed argv=%s rc=%d", argv[0], done.returncode)
        return None
    return done.stdout


def tail_text(path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_TAIL_BYTES) -> str:
    """The last `max_bytes` of a text file, starting at a line boundary; "" if unreadable."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(size - max_bytes, 0)
            f.seek(start)
            data = f.read(max_bytes)
    except OSError:
        return ""
    if start > 0:
        newline = data.find(b"\n")
        data = data[newline + 1 :] if newline >= 0 else data
    return data.decode("utf-8", errors="replace")


def read_error_file(path: str | os.PathLike[str] | None = None) -> str | None:
    """The torchelastic error file's text (default: `$TORCHELASTIC_ERROR_FILE`); None if absent."""
    if path is None:
        path = os.environ.get(ERROR_FILE_ENV) or None
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_ERROR_FILE_BYTES)
    except OSError:
        return None
    return data.decode("utf-8", errors="replace") or None


def read_oom_kill_count(
    *,
    pid: int | str = "self",
    proc_root: str | os.PathLike[str] = "/proc",
    cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
) -> int | None:
    """The `oom_kill` counter of `pid`'s memory cgroup (v1 or v2); None where unreadable."""
    try:
        membership = Path(proc_root, str(pid), "cgroup").read_text()
    except OSError:
        return None
    v1_path = v2_path = None
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers = parts[1].split(",")
        if "memory" in controllers:
            v1_path = parts[2]
        elif parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
    candidates = []
    if v1_path is not None:
        candidates.append(_under(cgroup_root, "memory", v1_path, "memory.oom_control"))
    if v2_path is not None:
        candidates.append(_under(cgroup_root, v2_path, "memory.events"))
        candidates.append(_under(cgroup_root, "unified", v2_path, "memory.events"))
    for file in candidates:
        count = _read_counter(file, "oom_kill")
        if count is not None:
            return count
    return None


def read_uptime_s(*, proc_root: str | os.PathLike[str] = "/proc") -> float | None:
    """Seconds since boot, the clock of kernel-log timestamps; None where unreadable."""
    try:
        return float(Path(proc_root, "uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def read_kernel_log(*, run: CommandRunner = run_quietly) -> list[str]:
    """Kernel-log lines from `dmesg`; [] when it is not installed or not permitted."""
    out = run(["dmesg"], timeout_s=DMESG_TIMEOUT_S)
    return out.splitlines() if out else []


def relevant_kernel_lines(
    lines: Iterable[str],
    *,
    pids: Collection[int] = (),
    since_uptime_s: float | None = None,
) -> list[str]:
    """Lines about this failure: OOM kills of `pids` and GPU/host hardware errors.

    With `since_uptime_s`, lines stamped earlier are dropped; unstamped lines are kept only
    when no start time is given.
    """
    kept = []
    for line in lines:
        if since_uptime_s is not None:
            stamp = _KERNEL_TIME.match(line)
            if stamp is None or float(stamp.group(1)) < since_uptime_s:
                continue
        oom_pid = oom_killed_pid(line)
        if oom_pid is not None:
            if not pids or oom_pid in pids:
                kept.append(line.strip())
        elif _HARDWARE_KERNEL.search(line):
            kept.append(line.strip())
    return kept


def oom_killed_pid(line: str) -> int | None:
    """The PID named by a kernel OOM-kill line, else None."""
    match = _OOM_KILLED_PID.search(line)
    if match is None:
        return None
    return int(match.group(1) or match.group(2))


def collect_evidence(
    *,
    exit_code: int | None,
    signal: int | None = None,
    worker_pids: Collection[int] = (),
    log_path: str | os.PathLike[str] | None = None,
    error_file: str | os.PathLike[str] | None = None,
    oom_kills_before: int | None = None,
    since_uptime_s: float | None = None,
    log_tail_bytes: int = DEFAULT_TAIL_BYTES,
    extra_hardware_patterns: Sequence[str] = (),
    extra_software_patterns: Sequence[str] = (),
    run: CommandRunner = run_quietly,
    proc_root: str | os.PathLike[str] = "/proc",
    cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
) -> FailureEvidence:
    """Gather everything readable about one worker failure on this node.

    `oom_kills_before` is `read_oom_kill_count()` taken when the workers started (the workers
    share the agent's cgroup under Slurm); a higher count now means the OOM killer struck.
    """
    notes: list[str] = []
    oom_killed = False
    count = read_oom_kill_count(proc_root=proc_root, cgroup_root=cgroup_root)
    if oom_kills_before is not None and count is not None and count > oom_kills_before:
        oom_killed = True
        notes.append(f"memory cgroup oom_kill counter rose from {oom_kills_before} to {count}")
    kernel = relevant_kernel_lines(
        read_kernel_log(run=run), pids=worker_pids, since_uptime_s=since_uptime_s
    )
    killed = [line for line in kernel if oom_killed_pid(line) in worker_pids]
    if killed:
        oom_killed = True
        notes.append(f"kernel log: OOM killer ended worker pid {oom_killed_pid(killed[0])}")
    return FailureEvidence(
        exit_code=exit_code,
        signal=signal,
        oom_killed=oom_killed,
        error_file_text=read_error_file(error_file),
        log_tail=tail_text(log_path, max_bytes=log_tail_bytes) if log_path is not None else "",
        kernel_lines=tuple(kernel),
        notes=tuple(notes),
        extra_hardware_patterns=tuple(extra_hardware_patterns),
        extra_software_patterns=tuple(extra_software_patterns),
    )


def _under(root: str | os.PathLike[str], *parts: str) -> Path:
    return Path(root, *(p.strip("/") for p in parts if p.strip("/")))


def _read_counter(file: Path, key: str) -> int | None:
    try:
        text = file.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return None
    return None
