"""The job directory: where it is (``--job-dir`` and its default), making it (mode 0700), and
the one owner of the master's files in it.

``$SLURM_SUBMIT_DIR/.dlrover-hpc/$SLURM_JOB_ID`` under Slurm, else under the current directory
(docs/design/architecture.md section 4).  The master's files are named here, and written and
read only through this module: ``master.json`` (where the master listens), ``master.lease`` (its
renewals), ``journal.jsonl`` and ``events.jsonl`` (their paths; the record logic is
:mod:`dlrover_hpc.master.journal`'s) and ``hangs/`` (one directory per hang report).  Imports
nothing from the package but its errors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import re
import secrets
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dlrover_hpc import environ
from dlrover_hpc.errors import ConfigError

MASTER_INFO = "master.json"  # written by the master once it listens: host, port, pid, job_id
LEASE = "master.lease"  # rewritten by the serving master every few tenths of a second
JOURNAL = "journal.jsonl"  # the master's records, replayed by a restarted master
EVENTS = "events.jsonl"  # the job's event log (the master is its one writer)
HANGS = "hangs"  # one directory per hang report (stacks, the detector's evidence)
TOKEN = "token"  # the job token (mode 0600), unless the environment gives it
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


def journal_path(job_dir: Path) -> Path:
    return job_dir / JOURNAL


def events_path(job_dir: Path) -> Path:
    return job_dir / EVENTS


def hang_report_dir(job_dir: Path, stamp: str) -> Path:
    """Where the hang report named ``stamp`` goes (not created here)."""
    return job_dir / HANGS / stamp


def _replace_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_master_info(job_dir: Path, info: Mapping[str, Any]) -> None:
    """Publish where the master listens (``host``, ``port``, ``pid``, ``epoch`` ...)."""
    _replace_text(job_dir / MASTER_INFO, json.dumps(dict(info)))


def load_master_info(job_dir: Path) -> dict[str, Any]:
    """``master.json`` as written by :func:`write_master_info`.  Raises OSError when it cannot
    be read (FileNotFoundError: no master has written it), ValueError when it is no JSON and
    TypeError when it is no JSON object; callers that only look for a master use
    :func:`read_master_info`."""
    info = json.loads((job_dir / MASTER_INFO).read_text())
    if not isinstance(info, dict):
        raise TypeError(f"expected a JSON object, found {type(info).__name__}")
    return info


def read_master_info(job_dir: Path) -> dict[str, Any] | None:
    """``master.json``, or None when it is missing, unreadable or not a JSON object."""
    try:
        return load_master_info(job_dir)
    except (OSError, ValueError, TypeError):
        return None


def master_address(info: Mapping[str, Any]) -> tuple[str, int]:
    """``(host, port)`` from a ``master.json``; KeyError or ValueError when it names none."""
    return str(info["host"]), int(info["port"])


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    epoch: int
    time: float  # wall clock of the master's newest renewal
    host: str
    pid: int


def write_lease(job_dir: Path, epoch: int) -> None:
    """Renew the lease of the master of ``epoch`` (this process, now)."""
    lease = Lease(epoch, time.time(), socket.gethostname().split(".")[0], os.getpid())
    _replace_text(job_dir / LEASE, json.dumps(dataclasses.asdict(lease)))


def read_lease(job_dir: Path) -> Lease | None:
    """The newest renewal, or None when there is none (or a torn one)."""
    try:
        raw = json.loads((job_dir / LEASE).read_text())
        return Lease(int(raw["epoch"]), float(raw["time"]), str(raw["host"]), int(raw["pid"]))
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


# ------------------------------------------------------------------ the job token
def resolve_token(job_dir: Path, *, create: bool) -> str:
    """The job token: :data:`environ.TOKEN`, else the job directory's ``token`` file (made,
    mode 0600 in the 0700 directory, if ``create``)."""
    path = job_dir / TOKEN
    token = os.environ.get(environ.TOKEN, "")
    if token:
        if create and not path.exists():  # lets `dlrover-hpc status` of the same user in
            _write_private(path, token)  # (the job directory is mode 0700)
        return token
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    if not create:
        raise ConfigError(
            f"no job token: set {environ.TOKEN} (the sbatch templates do) or start the master "
            f"first so it writes {path}"
        )
    token = secrets.token_hex(32)
    _write_private(path, token)
    return token


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
