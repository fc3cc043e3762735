"""One agent of a job per node."""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

from dlrover_hpc.errors import DlroverHpcError
from dlrover_hpc.jobdir import local_user


def hold_node_lock(job_dir: Path, node: str) -> int:
    """One agent of a job per node under Slurm: a relaunch (``srun -w NODE``) that finds the
    old agent alive (it only lost its link and will reconnect) must not start a second.

    Returns the locked descriptor (close-on-exec; keep it open while the agent runs), or -1
    outside Slurm."""
    if not os.environ.get("SLURM_JOB_ID"):
        return -1
    key = hashlib.sha1(str(job_dir.resolve()).encode()).hexdigest()[:12]
    path = f"/tmp/dlrover-hpc-{local_user()}-{key}-{node}.agent.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DlroverHpcError(
            f"another dlrover-run of this job (pid {holder}) is running on {node}; "
            f"not starting a second agent (lock {path})"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
