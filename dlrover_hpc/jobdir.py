"""Where a job's directory is (``--job-dir`` and its default), and making it (mode 0700).

``$SLURM_SUBMIT_DIR/.dlrover-hpc/$SLURM_JOB_ID`` under Slurm, else under the current directory
(docs/ARCHITECTURE.md section 4).  Imports nothing from the package but its errors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from dlrover_hpc.errors import ConfigError

MASTER_INFO = "master.json"  # written by the master once it listens: host, port, pid, job_id


def default_job_dir(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID"):
        base = env.get("SLURM_SUBMIT_DIR") or os.getcwd()
        return os.path.join(base, ".dlrover-hpc", env["SLURM_JOB_ID"])
    return os.path.join(os.getcwd(), ".dlrover-hpc", "standalone")


def make_job_dir(path: str | os.PathLike[str]) -> Path:
    """Create the job directory (mode 0700); raises ConfigError naming it when that fails."""
    job_dir = Path(path)
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(job_dir, 0o700)
    except OSError as exc:
        raise ConfigError(
            f"job directory {job_dir}: cannot create it ({exc.strerror or exc}); "
            "pass --job-dir DIR with a directory you can write"
        ) from None
    return job_dir
