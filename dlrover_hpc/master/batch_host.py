"""A job whose batch host died: the master ends the allocation once the job is done.

Slurm 22.05 keeps a ``--no-kill`` job (the templates') RUNNING on its other nodes when the node
that runs its batch script fails (:func:`dlrover_hpc.slurm.job_fate.batch_host_lost`).  An agent
takes over as master and the job goes on; but the batch script, which ends the job with the
master's exit code, is gone with its node, so nothing would end the job before its time limit:
its nodes would stay allocated.  At the job's end the master (whichever host runs it) asks
Slurm, and when the batch host is lost it emits ``batch_host_lost`` and cancels the job
(``scancel``: Slurm shows it ``CANCELLED``; the job's own verdict is ``job_finished``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from dlrover_hpc.errors import SlurmError
from dlrover_hpc.events import EventName
from dlrover_hpc.slurm import commands as slurm
from dlrover_hpc.slurm import job_fate

log = logging.getLogger(__name__)


def end_orphaned_job(
    job_id: str,
    *,
    exit_code: int,
    emit: Callable[..., Any],
    environ: Mapping[str, str] | None = None,
    run: slurm.Runner = slurm.run_command,
) -> bool:
    """After the job's verdict: cancels the job when its batch host is lost; True if it did.
    Only inside that Slurm job (``SLURM_JOB_ID``); runs Slurm commands (a worker thread)."""
    environ = os.environ if environ is None else environ
    if not job_id or environ.get("SLURM_JOB_ID") != job_id:
        return False
    try:
        host = job_fate.batch_host_lost(slurm.show_job(job_id, run=run))
        if host is None:
            return False
        emit(EventName.BATCH_HOST_LOST, node=host, job=job_id, exit_code=exit_code)
        log.warning(
            "batch host lost node=%s job=%s: no job script is left to end the job; cancelling "
            "it now that it finished (exit code %d, see job_finished)",
            host,
            job_id,
            exit_code,
        )
        slurm.cancel_job(job_id, run=run)
    except SlurmError as exc:
        log.warning("batch host check failed job=%s error=%s", job_id, exc)
        return False
    return True
