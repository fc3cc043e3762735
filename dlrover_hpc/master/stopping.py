"""The master's side of a graceful end (time limit, preemption): see :mod:`continuation`.

:class:`GracefulStop` turns a request (Slurm's signal through ``dlrover-hpc stop``, SIGTERM,
or the time limit drawing near) into a :class:`StopPlan`, tells the agents where to stop,
ends the job at the deadline if the workers have not ended it first, and, once the job is
over, reports the step it kept and starts the next run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from dlrover_hpc.master.continuation import Continuer, StopKind, StopPlan, stop_kind, stop_step
from dlrover_hpc.master.job import Job
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.master.steps import StepLog
from dlrover_hpc.protocol import messages as m

log = logging.getLogger(__name__)

#: seconds before the deadline that a stop requested by signal leaves to Slurm's kill
KILL_MARGIN_S = 10.0
#: the longest a stop waits for the ranks' next save (a job stopped long before its time limit,
#: by hand or by a signal); then the agents persist the newest step in memory
MAX_STOP_WAIT_S = 3600.0
#: seconds the agents get, after a SIGTERM, before Slurm's SIGKILL (KillWait, default 30)
SIGTERM_GRACE_S = 20.0
#: seconds a stop waits for a new round's first save or restore (its steps are unknown before)
FRESH_ROUND_WAIT_S = 20.0


def stop_deadline(now: float, left_s: float | None, within_s: float | None) -> float:
    """When a stop gives up waiting for the ranks' save: ``within_s`` from ``now``, by default
    the time left before the limit less a margin, but not days (a job stopped by hand long
    before its limit): within the hour; 60 s with no limit known; never under 5 s."""
    if within_s is None:
        within_s = min(left_s - KILL_MARGIN_S, MAX_STOP_WAIT_S) if left_s is not None else 60.0
    return now + max(5.0, within_s)


class GracefulStop:
    def __init__(
        self,
        job: Job,
        steps: StepLog,
        push: Callable[[str, m.Message], None],
        *,
        lead_s: float,
        rank_step: Callable[[], int] = lambda: -1,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.job, self.steps, self.lead_s, self._wall = job, steps, lead_s, wall
        self._push = push
        self._rank_step = rank_step
        self.continuer: Continuer | None = None  # set under Slurm
        self.plan: StopPlan | None = None
        self.time_left_s: float | None = None  # at the last check of the time limit
        self._checked_at = 0.0
        self.forced = False  # the job ended by the deadline (or no round ran), not by a save
        self._requested_at = 0.0
        self.sent = False  # the agents have the stop step
        self._sent_round = 0

    def request(
        self, kind: StopKind | None, reason: str, *, within_s: float | None = None
    ) -> StopPlan | None:
        """Stop the job at a step boundary by ``within_s`` from now (default: the time left
        before the limit, less a margin, or 60 s); ``kind`` None: decided by the time left."""
        if self.plan is not None or self.job.ended:
            return self.plan
        now = self._wall()
        left = self._left_now(now)
        kind = kind or stop_kind(left, self.lead_s)
        deadline = stop_deadline(now, left, within_s)
        self.plan = StopPlan(kind=kind, reason=reason, step=-1, deadline=deadline)
        self._requested_at = now
        self.job.stopping = f"{kind.value}: {reason}"
        log.warning(
            "graceful stop kind=%s reason=%s deadline_in_s=%.1f", kind, reason, deadline - now
        )
        if not (self.job.phase is Phase.RUNNING and self.job.participants()):
            # No round trains: nothing newer than the committed step to keep.
            self.forced = True
            self.job.finish(0, f"{self.job.stopping}; no round was running")
            return self.plan
        self._send_when_known()
        return self.plan

    def _send_when_known(self) -> None:
        """Sends the stop step once the round's steps are known: a round that has not saved
        or restored yet may be restoring a step far past what its ranks reported (0)."""
        assert self.plan is not None
        seen = self._rank_step()
        waited = self._wall() - self._requested_at
        if seen < 0 and self.steps.newest <= 0 and waited < FRESH_ROUND_WAIT_S:
            return  # check() comes back
        rate = self.steps.step_rate()
        if rate <= 0 and waited < FRESH_ROUND_WAIT_S:
            # Unknown, the rate would leave the stop step 2 past the newest step reported (a
            # heartbeat old): ranks that read the notice after passing it stop later than the
            # others, whose exit then breaks their collectives. check() comes back.
            return
        notice_s = 2 * self.job.config.heartbeat_every_s + 1.0
        step = stop_step(max(self.steps.newest, seen), rate, notice_s)
        self.plan = dataclasses.replace(self.plan, step=step)
        self.sent, self._sent_round = True, self.job.round
        log.warning("graceful stop at step=%d round=%d", step, self.job.round)
        notice = m.StopAt(step=step, deadline=self.plan.deadline, reason=self.job.stopping)
        for agent in self.job.active_agents():
            self._push(agent, notice)

    def _left_now(self, now: float) -> float | None:
        if self.time_left_s is None:
            return None
        return self.time_left_s - (now - self._checked_at)

    def time_checked(self, left_s: float | None) -> None:
        """The time left before the limit, as Slurm said it just now (a worker thread asks)."""
        self.time_left_s, self._checked_at = left_s, self._wall()

    def check(self) -> None:
        """On the master's timer: the time limit drawing near, and the deadline of a stop."""
        if self.job.ended:
            return
        now = self._wall()
        if self.plan is None:
            left = self._left_now(now)
            if self.lead_s > 0 and left is not None and left <= self.lead_s:
                self.request(StopKind.TIME_LIMIT, f"{left:.0f} s left before the time limit")
            return
        if self.sent and self._sent_round != self.job.round and self.job.phase is Phase.RUNNING:
            self.sent, self._requested_at = False, now  # a new round: new workers, tell them
        if not self.sent and self.job.phase is Phase.RUNNING:
            self._send_when_known()
        if now >= self.plan.deadline:
            log.warning("graceful stop deadline reached: the agents keep the newest step")
            self.forced = True
            self.job.finish(0, f"{self.job.stopping}; deadline reached before a save")

    def conclude(self) -> str | None:
        """After the job ended (and its agents persisted): the event with the kept step, and
        the next run; returns the next run's job id.  Runs Slurm commands: a worker thread."""
        plan = self.plan
        if plan is None:
            return None
        if self.job.crash_loop is not None:  # a crash loop is never continued
            log.warning("graceful stop: the job ended in a crash loop; nothing to continue")
            return None
        if not self.forced and not any(n.stopped for n in self.job.participants()):
            log.info("graceful stop: training ended before the stop step; nothing to continue")
            return None
        kept = self.job.last_committed
        self.job.emit(
            plan.kind.event,
            step=kept,
            stop_step=plan.step,
            reason=plan.reason,
        )
        if self.continuer is None:
            return None
        return self.continuer.continue_job(plan, kept)


#: seconds between two questions to Slurm about the time left (a limit may be changed)
TIME_LEFT_EVERY_S = 60.0


async def watch_time_left(stopper: GracefulStop) -> None:
    """Asks Slurm for the time left now and then; :meth:`GracefulStop.check` acts on it."""
    continuer = stopper.continuer
    if continuer is None or stopper.lead_s <= 0:
        return
    while not stopper.job.ended:
        try:
            stopper.time_checked(await asyncio.to_thread(continuer.time_left))
        except Exception as exc:  # Slurm busy: ask again later
            log.warning("time left unknown error=%s", exc)
        await asyncio.sleep(TIME_LEFT_EVERY_S)


async def on_sigterm(stopper: GracefulStop) -> None:
    """Slurm's SIGTERM: a preemption (or the time limit) is ending the job in KillWait
    seconds: keep the newest step and continue, unless the user cancelled the job."""
    continuer = stopper.continuer
    if continuer is None or await asyncio.to_thread(continuer.cancelled):
        stopper.job.request_stop("SIGTERM")
        return
    stopper.request(None, "SIGTERM from Slurm", within_s=SIGTERM_GRACE_S)
