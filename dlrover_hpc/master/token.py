"""The job token: :data:`environ.TOKEN`, or a 0600 file in the 0700 job directory."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from dlrover_hpc import environ
from dlrover_hpc.errors import ConfigError

TOKEN_ENV = environ.TOKEN


def resolve_token(job_dir: Path, *, create: bool) -> str:
    """The job token variable, else the job directory's ``token`` file (made if ``create``)."""
    path = job_dir / "token"
    token = os.environ.get(TOKEN_ENV, "")
    if token:
        if create and not path.exists():  # lets `dlrover-hpc status` of the same user in
            _write_private(path, token)  # (the job directory is mode 0700)
        return token
    with contextlib.suppress(FileNotFoundError):
        return path.read_text().strip()
    if not create:
        raise ConfigError(
            f"no job token: set {TOKEN_ENV} (the sbatch templates do) or start the master first "
            f"so it writes {path}"
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
