"""Where a job's directory is (``--job-dir`` and its default), and making it (mode 0700).

``$SLURM_SUBMIT_DIR/.dlrover-hpc/$SLURM_JOB_ID`` under Slurm, else under the current directory
(docs/ARCHITECTURE.md section 4).  Imports nothing from the package but its errors.
"""

from __future__ import annotations

import json
import os
import pwd
import re
from collections.abc import Mapping
from pathlib import Path

from dlrover_hpc.errors import ConfigError

MASTER_INFO = "master.json"  # written by the master once it listens: host, port, pid, job_id
#: DLRover's parallelism config (``{"dataloader": {"version": N, "batch_size": B}}``): the
#: workers' ElasticDataLoader reads it; ``dlrover-hpc batch-size`` writes it
PARAL_CONFIG = "paral_config.json"
PARAL_CONFIG_ENV = "DLROVER_PARAL_CONFIG_PATH"  # DLRover's variable


def user_name() -> str:
    """This process's user as the kernel knows it (its effective uid), not ``$USER`` or
    ``$LOGNAME``, which a job may inherit from whoever submitted it (``runuser``, ``sbatch
    --export``); ``uid<N>`` for a uid with no passwd entry (a container, a site's own NSS)."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid{os.geteuid()}"


def local_user() -> str:
    """:func:`user_name` in the names of this process's files in a shared directory (``/tmp``,
    ``/dev/shm``), with only name-safe characters: taken from the environment, a name could
    collide with another user's files on a shared node."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", user_name())


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


def write_batch_size(job_dir: Path, batch_size: int) -> int:
    """Set the workers' ElasticDataLoader batch size: rewrite the job's parallelism config
    with the next version (atomically); returns that version."""
    if batch_size < 1:
        raise ConfigError(f"batch size {batch_size}: must be at least 1")
    path = job_dir / PARAL_CONFIG
    version = 0
    try:
        old = json.loads(path.read_text())
        version = int(old.get("dataloader", {}).get("version", 0))
    except FileNotFoundError:
        pass
    except (ValueError, AttributeError, TypeError) as exc:
        raise ConfigError(f"{path} is not a parallelism config ({exc}); remove it") from None
    version += 1
    tmp = path.with_name(f".{PARAL_CONFIG}.{os.getpid()}")
    tmp.write_text(json.dumps({"dataloader": {"version": version, "batch_size": batch_size}}))
    os.replace(tmp, path)
    return version
