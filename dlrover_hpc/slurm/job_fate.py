"""What ``scontrol -o show job`` says about a job whose node died (pure, on its fields).

Measured on Slurm 22.05 (docs/guide/failures.md, "The batch host dies"): when the node that runs
the batch script fails, a ``--no-kill`` job is not ended or requeued; Slurm drops the node and
the job stays ``RUNNING`` on the others with ``BatchHost`` still naming the dead node
(:func:`batch_host_lost`).  Without ``--no-kill`` a requeueable job is requeued at once:
``Restarts`` grows while the old run's processes are ended (``JobState=COMPLETING``), then the
job pends (:func:`requeued`).
"""

from __future__ import annotations

from collections.abc import Mapping

from dlrover_hpc.errors import UsageError
from dlrover_hpc.slurm.hostnames import expand

#: Job states that end a job for good (a requeue cannot follow).
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


def requeued(job: Mapping[str, str], *, restart_count: int) -> bool:
    """Whether the job was requeued after the run that has ``restart_count`` (its
    ``SLURM_RESTART_COUNT``; 0 when unset) started, and is not over for good."""
    try:
        restarts = int(job.get("Restarts", "0"))
    except ValueError:
        return False
    return restarts > restart_count and job.get("JobState", "") not in FINAL_STATES


def batch_host_lost(job: Mapping[str, str]) -> str | None:
    """The dead batch host of a job that runs on without it (its ``BatchHost`` is no longer
    among its nodes), else None.  No batch script is left to end such a job."""
    host = job.get("BatchHost", "")
    running = job.get("JobState") == "RUNNING" and job.get("BatchFlag") == "1"  # not salloc
    if not running or not host or host == "(null)":
        return None
    try:
        nodes = expand(job.get("NodeList", ""), source="scontrol show job NodeList")
    except UsageError:
        return None
    return host if host not in nodes else None
