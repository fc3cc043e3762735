"""Who is the job's master: epochs, the lease, and taking over from a dead master.

The job directory (on the shared file system) holds the facts every candidate reads:

- ``master-epoch-N``: created with ``O_EXCL`` by the one master that serves epoch N.  A new
  master (the job script restarting the master step, or an agent promoted when the master's
  node died) claims the next epoch; two candidates never both get it.
- ``master.lease``: the serving master rewrites it every :data:`LEASE_EVERY_S` (epoch and wall
  time).  A candidate takes over only when the lease is stale: a master that is alive but that
  one agent cannot reach (a cut link) keeps its job.
- ``master-config.json``: the first master's configuration, so a promoted agent serves the job
  with the same flags (``--nnodes``, ``--drain``, ``--topology`` ...) as the master step did.

A master that sees a newer epoch claimed steps down at once (fencing): the journal then has one
writer.  Pure file operations; callers on an event loop run them in a thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

from dlrover_hpc.config import DrainMode, MasterConfig, NodeRange, RequeueBy
from dlrover_hpc.errors import DlroverHpcError
from dlrover_hpc.jobdir import LEASE, Lease, read_lease
from dlrover_hpc.jobdir import write_lease as write_lease  # the lease is jobdir's

log = logging.getLogger(__name__)

CONFIG = "master-config.json"
#: The master renews its lease this often; a lease older than STALE_S has no live master.
LEASE_EVERY_S, STALE_S = 0.5, 2.5
_EPOCH = re.compile(r"master-epoch-(\d+)$")


class MasterServing(DlroverHpcError):
    """Another master holds a live lease on this job: this one must not start."""


def epoch_path(job_dir: Path, epoch: int) -> Path:
    return job_dir / f"master-epoch-{epoch}"


def newest_epoch(job_dir: Path) -> int:
    """The highest epoch claimed in ``job_dir`` (0: none yet)."""
    epochs = [int(mt.group(1)) for p in job_dir.iterdir() if (mt := _EPOCH.match(p.name))]
    return max(epochs, default=0)


def claim(job_dir: Path, epoch: int) -> bool:
    """Claim ``epoch``; False when another candidate already did."""
    try:
        fd = os.open(epoch_path(job_dir, epoch), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{socket.gethostname().split('.')[0]} {os.getpid()}\n")
    return True


def superseded(job_dir: Path, epoch: int) -> bool:
    """A newer master claimed the job: the master of ``epoch`` must step down."""
    return epoch_path(job_dir, epoch + 1).exists()


def lease_fresh(lease: Lease | None, now: float) -> bool:
    return lease is not None and now - lease.time < STALE_S


def take_over(job_dir: Path, *, epoch: int | None = None, wait_s: float = STALE_S + 1.0) -> int:
    """Claim the next epoch (``epoch``: exactly that one) once no master holds a fresh lease.

    A master killed a moment ago leaves a lease that goes stale within :data:`STALE_S`: wait up
    to ``wait_s`` for that.  Raises :class:`MasterServing` when a live master keeps renewing it
    or another candidate claimed the epoch first.  Returns the epoch now held.
    """
    deadline = time.monotonic() + wait_s
    while lease_fresh(read_lease(job_dir), time.time()):
        if time.monotonic() >= deadline:
            lease = read_lease(job_dir)
            where = f"{lease.host} pid {lease.pid}" if lease else "?"
            raise MasterServing(
                f"a job master ({where}) renews {job_dir / LEASE}: it serves this job"
            )
        time.sleep(0.2)
    wanted = newest_epoch(job_dir) + 1 if epoch is None else epoch
    if not claim(job_dir, wanted):
        raise MasterServing(f"another master claimed epoch {wanted} of {job_dir} first")
    log.info("master epoch claimed epoch=%d job_dir=%s", wanted, job_dir)
    return wanted


def save_config(job_dir: Path, config: MasterConfig) -> None:
    """The master step's configuration, for a master promoted in an agent (first one wins)."""
    path = job_dir / CONFIG
    if path.exists():
        return
    raw: dict[str, Any] = {
        **dataclasses.asdict(config),
        "drain": config.drain.value,
        "requeue_by": config.requeue_by.value,
    }
    tmp = job_dir / f".{CONFIG}.{os.getpid()}"
    tmp.write_text(json.dumps(raw))
    os.replace(tmp, path)


def load_config(job_dir: Path, **overrides: Any) -> MasterConfig | None:
    """The saved configuration with ``overrides``; None when no master saved one."""
    try:
        raw = json.loads((job_dir / CONFIG).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    raw["nnodes"] = NodeRange(**raw["nnodes"])
    raw["drain"] = DrainMode(raw["drain"])
    raw["requeue_by"] = RequeueBy(raw.get("requeue_by", RequeueBy.DLROVER_HPC.value))
    known = {f.name for f in dataclasses.fields(MasterConfig)}
    return MasterConfig(**{k: v for k, v in {**raw, **overrides}.items() if k in known})
