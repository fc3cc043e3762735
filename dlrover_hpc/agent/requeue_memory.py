"""Flash checkpoints that outlive a requeue: an agent ended because Slurm requeued its job
keeps the node's segments for the requeued run.

When the batch host fails (without ``--no-kill``: any node), Slurm requeues a requeueable job
at once and ends every step on the surviving nodes: their agents get SIGTERM.  The segment
names carry the user, the job id (which a requeue keeps) and the node, so the requeued run's
workers on the same nodes find them and restore from memory (then a peer, then storage, as
:mod:`dlrover_hpc.checkpoint.trainer.restore_agreement` orders them).  Slurm says a job was
requeued by counting it in ``Restarts``, which the agent compares with its own run's
``SLURM_RESTART_COUNT`` (:func:`dlrover_hpc.slurm.job_fate.requeued`).  Everywhere else (the
job finished, failed, was cancelled or timed out) the agent removes them as before.

Kept segments go when the job really ends: the requeued run's agents remove the job's
segments on their nodes at its end, and an agent that starts on a node removes its user's
segments of jobs Slurm no longer lists (:func:`stale_segments`: a continuation that landed
elsewhere, a requeue that never ran).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Collection, Mapping

from dlrover_hpc.checkpoint.env import (
    DEFAULT_SHM_DIR,
    SEGMENT_PREFIX,
    current_user,
    safe_component,
)
from dlrover_hpc.errors import SlurmError
from dlrover_hpc.slurm import commands as slurm
from dlrover_hpc.slurm import job_fate
from dlrover_hpc.slurm.env import parse_slurm_env

log = logging.getLogger(__name__)

#: How long the agent, stopped by Slurm, waits for ``scontrol`` (inside Slurm's KillWait).
ASK_TIMEOUT_S = 5.0


def keep_for_requeue(
    environ: Mapping[str, str], *, segments: bool = True, run: slurm.Runner = slurm.run_command
) -> bool:
    """Under Slurm: whether this node's segments must outlive this agent (its job was
    requeued); False without Slurm, without ``segments`` on the node (then Slurm is not
    asked) or when Slurm cannot tell (then they are removed)."""
    env = parse_slurm_env(environ)
    if env is None or not segments:
        return False
    try:
        job = slurm.show_job(env.job_id, run=run, timeout_s=ASK_TIMEOUT_S)
    except SlurmError as exc:
        log.warning(
            "checkpoint requeue_unknown job=%s error=%s: removing segments", env.job_id, exc
        )
        return False
    keep = job_fate.requeued(job, restart_count=env.restart_count)
    if keep:
        log.info(
            "checkpoint segments_kept job=%s restarts=%s state=%s: the job was requeued; its "
            "next run restores from them on this node",
            env.job_id,
            job.get("Restarts"),
            job.get("JobState"),
        )
    return keep


_JOB = re.compile(r"^(?P<user>[^-]+)-(?P<job>\d+)-")


def stale_segments(names: Collection[str], *, user: str, live_jobs: Collection[str]) -> list[str]:
    """The names (in /dev/shm) of ``user``'s segments of Slurm jobs not in ``live_jobs`` (the
    user's jobs Slurm still lists: pending, running, completing).  Only numeric job ids:
    standalone runs' and other users' names are never touched."""
    mine = SEGMENT_PREFIX + safe_component(user) + "-"
    out = []
    for name in names:
        if not name.startswith(mine):
            continue
        m = _JOB.match(name[len(SEGMENT_PREFIX) :])
        if m and m["job"] not in live_jobs:
            out.append(name)
    return sorted(out)


def sweep_stale(
    environ: Mapping[str, str],
    *,
    shm_dir: str = DEFAULT_SHM_DIR,
    run: slurm.Runner = slurm.run_command,
) -> list[str]:
    """Under Slurm: removes from ``shm_dir`` this user's segments of jobs Slurm no longer
    lists (:func:`stale_segments`); returns the removed names.  Nothing when Slurm does not
    answer."""
    env = parse_slurm_env(environ)
    if env is None:
        return []
    user = current_user()
    try:
        names = stale_segments(os.listdir(shm_dir), user=user, live_jobs={env.job_id})
        if not names:  # a clean node asks Slurm nothing (no squeue from every node of a job)
            return []
        live = slurm.my_job_ids(run=run, timeout_s=ASK_TIMEOUT_S) | {env.job_id}
    except (SlurmError, OSError) as exc:
        log.info("checkpoint stale_segments_not_swept error=%s", exc)
        return []
    removed = []
    for name in stale_segments(names, user=user, live_jobs=live):
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except OSError:
            continue
    if removed:
        log.info("checkpoint stale_segments_removed count=%d first=%s", len(removed), removed[0])
    return removed


def stale_tiers(names: Collection[str], *, user: str, live_jobs: Collection[str]) -> list[str]:
    """The names (in a ``--local-ckpt-dir``) of ``user``'s local tiers of Slurm jobs not in
    ``live_jobs`` (:func:`dlrover_hpc.checkpoint.saver.local_tier.job_key`'s names)."""
    mine = re.compile(re.escape(safe_component(user)) + r"_(?P<job>\d+)_")
    return sorted(n for n in names if (m := mine.match(n)) and m["job"] not in live_jobs)


def sweep_stale_tiers(
    environ: Mapping[str, str], local_dir: str, *, run: slurm.Runner = slurm.run_command
) -> list[str]:
    """Under Slurm: removes from ``local_dir`` this user's local tiers of jobs Slurm no longer
    lists (a continuation that became a new job, a node that never ran the requeued job)."""
    env = parse_slurm_env(environ)
    if env is None:
        return []
    user = current_user()
    try:
        names = stale_tiers(os.listdir(local_dir), user=user, live_jobs={env.job_id})
        if not names:
            return []
        live = slurm.my_job_ids(run=run, timeout_s=ASK_TIMEOUT_S) | {env.job_id}
    except (SlurmError, OSError) as exc:
        log.info("checkpoint stale_tiers_not_swept error=%s", exc)
        return []
    removed = stale_tiers(names, user=user, live_jobs=live)
    for name in removed:
        shutil.rmtree(os.path.join(local_dir, name), ignore_errors=True)
    if removed:
        log.info("checkpoint stale_local_tiers_removed dir=%s names=%s", local_dir, removed)
    return removed
