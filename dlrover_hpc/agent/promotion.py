"""An agent takes over as job master when the master's node died (issue 14).

A master whose process died is started again by the job script within seconds, and the agents
reconnect to it.  A master whose *node* died cannot be: the job script may have lost that node
too, and Slurm notices a dead node only after ``SlurmdTimeout``.  So the agents promote one of
themselves, by a rule each computes alone: an agent that has had no master for
:func:`promote_after` seconds (its node rank in the newest round it was in orders them:
rank 0 first, agents never in a round last) checks the job directory on the shared file
system.  It takes over only when no newer master is named there, the old master's lease is
stale (it is not merely unreachable from this node) and it wins the ``O_EXCL`` claim of the
next epoch; it then runs the master in-process, resumed from the journal with the first
master's configuration.  The other agents find the new
master in ``master.json``.  At most one re-rendezvous follows: the dead node's agent is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from dlrover_hpc import jobdir
from dlrover_hpc.agent.master_link import MasterLink
from dlrover_hpc.master import cluster, failover
from dlrover_hpc.master.thread import MasterThread

log = logging.getLogger(__name__)

#: No master for this long before the first candidate tries (the job script restarts a master
#: process that died in a few seconds; a promotion would only race it), then one more second
#: per place in the order.
PROMOTE_AFTER_S, PROMOTE_STEP_S = 10.0, 1.0
SPARE_ORDER = 64  # agents outside the running round come after its members


def promote_after(node_rank: int, slurm_node_id: int | None) -> float:
    """How long this agent waits without a master before it tries to take over."""
    order = node_rank if node_rank >= 0 else SPARE_ORDER + (slurm_node_id or 0) % 64
    return PROMOTE_AFTER_S + PROMOTE_STEP_S * order


def master_epoch(job_dir: Path) -> int:
    """The epoch ``master.json`` names (0: none, or a master that predates epochs)."""
    return _epoch_of(jobdir.read_master_info(job_dir))


def _epoch_of(info: dict[str, object] | None) -> int:
    try:
        return int(str(info.get("epoch", 0))) if info else 0
    except ValueError:
        return 0


def try_promote(job_dir: Path, *, lost_epoch: int, token: str) -> MasterThread | None:
    """Start the master of epoch ``lost_epoch + 1`` here, or None when this agent must not:
    a newer master exists, the old one still renews its lease, another agent won the claim,
    or no master ever saved its configuration.  Blocking: call it in a thread."""
    if master_epoch(job_dir) > lost_epoch:
        return None  # a new master is up (or starting): the link finds it in master.json
    if failover.lease_fresh(jobdir.read_lease(job_dir), time.time()):
        log.info("the master renews its lease: it is only unreachable from here; not promoting")
        return None
    config = failover.load_config(job_dir, host="0.0.0.0", port=0, embedded=True)
    if config is None:
        log.warning("no %s in %s: cannot take over as master", failover.CONFIG, job_dir)
        return None
    epoch = lost_epoch + 1
    if not failover.claim(job_dir, epoch):
        return None
    log.warning("promoted to job master epoch=%d job_dir=%s", epoch, job_dir)
    thread = MasterThread(
        config, token=token, job_dir=job_dir, cluster=cluster.from_env(), epoch=epoch
    )
    if not thread.start():
        log.error("the promoted master could not start; the job has no master")
        return None
    return thread


def where_master(
    job_dir: Path, current: tuple[str, int], epoch: int
) -> tuple[tuple[str, int], int]:
    """Where to connect: ``master.json``'s master when it is newer than ``epoch`` (the one this
    agent knew), else ``current``.  The first call (``epoch`` 0) only learns the epoch: the
    address the agent was given (``--master``, the endpoint, 127.0.0.1) stays.  ``epoch`` -1:
    the given address does not answer; any master ``master.json`` names is newer."""
    info = jobdir.read_master_info(job_dir)
    newest = _epoch_of(info)
    if info is None or newest <= epoch:
        return current, max(epoch, newest)
    named = jobdir.master_address(info)
    if epoch == 0 or named == current:
        return current, newest
    log.warning("master.json names a new master epoch=%d at %s:%d", newest, *named)
    return named, newest


async def watch(
    link: MasterLink,
    *,
    job_dir: Path,
    token: str,
    epoch: Callable[[], int],
    wait_s: Callable[[], float],
) -> MasterThread:
    """Until this agent has taken over as master (see :func:`try_promote`); ``epoch``: the
    master it knew, ``wait_s``: its :func:`promote_after`."""
    next_try = 0.0
    while True:
        await asyncio.sleep(1.0)
        down_since = link.down_since
        if down_since is None or link.gone.is_set():
            next_try = 0.0
            continue
        now = time.monotonic()
        if now - down_since < wait_s() or now < next_try:
            continue
        thread = await asyncio.to_thread(try_promote, job_dir, lost_epoch=epoch(), token=token)
        if thread is not None:
            return thread
        next_try = now + PROMOTE_AFTER_S  # another candidate's turn; look again later
