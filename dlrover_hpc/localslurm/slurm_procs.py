"""Processes of the local Slurm: run a system command, spawn a daemon, watch it, stop it.

Every failure is a :class:`LocalSlurmError` that names the command or what was awaited.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dlrover_hpc.errors import LocalSlurmError
from dlrover_hpc.localslurm.commands import apt_install, run_checked
from dlrover_hpc.localslurm.wait import wait_for

log = logging.getLogger(__name__)

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


def run(
    argv: Sequence[str],
    *,
    check: bool = True,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> str:
    """stdout of ``argv``; :class:`LocalSlurmError` with its stderr when it fails."""
    return run_checked(argv, error=LocalSlurmError, check=check, timeout_s=timeout_s, env=env)


def alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (a killed daemon lingers as one for a moment)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait(
    predicate: Callable[[], object], *, timeout_s: float, what: str, interval_s: float = 0.1
) -> None:
    """:func:`wait_for`, raising :class:`LocalSlurmError` at the deadline."""
    try:
        wait_for(predicate, timeout_s=timeout_s, what=what, interval_s=interval_s)
    except TimeoutError as exc:
        raise LocalSlurmError(str(exc)) from None


def spawn(argv: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None) -> int:
    """Start ``argv`` in its own session with stdout and stderr appended to ``log_path``."""
    logf = open(log_path, "ab")  # noqa: SIM115
    with logf:
        proc = subprocess.Popen(
            list(argv),
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
    return proc.pid


def terminate(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM ``pid``, then SIGKILL it if it still runs after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def install_packages() -> None:
    """Install Slurm and munge from Debian packages when one of their binaries is missing."""
    apt_install(PACKAGES, present=("slurmctld", "slurmd", "srun", "munged"), error=LocalSlurmError)
