"""``--persist-every``: the master has every node persist the same step held in memory.

A script that saves to memory often and to storage seldom (or never) loses, when a whole job
fails, everything since its newest step on storage.  With ``--persist-every`` the master, once
storage's newest step is older than the interval, tells every agent of the round to persist
its ranks' first save at or after one step (:class:`dlrover_hpc.protocol.messages.PersistStep`;
:mod:`dlrover_hpc.checkpoint.saver.persist_at` on the node): the same step everywhere, so it
commits like a DISK save.  When the script's own DISK saves commit more often than the interval,
nothing is asked.

``auto`` chooses the interval (:func:`persist_interval.daly_interval`) from the persist time
measured in this job (the slowest node's ``persist_s`` of a step, the median of the newest few
steps) and its MTBF (:func:`persist_interval.job_mtbf`: the failures that cost a restart, per
node-second trained, else ``--node-mtbf``).  Until a persist was measured, the first is asked
as soon as every rank holds a step in memory; once it committed, its persist time is waited
for (a node reports it after the commit) rather than a second step asked.  ``persist_interval``
says the interval when it is chosen and when it moves by more than a tenth.

A request is given up (and a later step asked) only once every rank saved the step to memory
and it still did not commit: a loaded machine's ranks may reach the step later than projected,
and a request given up before they reached it still commits, just before the next one.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

from dlrover_hpc.config import MasterConfig
from dlrover_hpc.events import EventName
from dlrover_hpc.master import persist_interval as pi
from dlrover_hpc.master.continuation import stop_step
from dlrover_hpc.master.job import Job
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.master.steps import StepLog
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.values import PERSIST_AUTO

log = logging.getLogger(__name__)

#: The persist time is the median of the slowest node's over this many newest steps.
PERSIST_SAMPLES = 5
#: A request whose step has not committed this long (plus four persists) after every rank
#: saved it to memory is given up, and the next one asks a later step.
REQUEST_TIMEOUT_S = 3.0
#: ... and one whose step the ranks have not reached this long after the ask (they stopped
#: reporting saves, or the rate was far off) is given up too.
REQUEST_BACKSTOP_S = 60.0
#: The step asked is this far ahead of where the ranks are now (their newest reports, projected
#: at the step rate), so the request reaches every node first; it is asked this long before the
#: interval ends, so that it commits when the interval has passed.  A projection that falls
#: short (a rate measured over a round's slow first steps) only brings the commit forward, up
#: to this much; past it, the ranks have saved beyond the step and it is asked again.
ASK_AHEAD_S = 2.5
#: ... but never more than this share of the interval: the step is chosen from a rate measured
#: before the ask, and a rate off by a factor f moves the commit by ``lead * (1 - 1/f)``, so a
#: lead of 2.5 s of a 3.2 s interval let a loaded machine (rates off by 2x and more) commit at
#: 1-2 s gaps; a quarter of the interval keeps any such error under a quarter of it.
ASK_AHEAD_SHARE = 0.25


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """The interval in use and what it was chosen from (``persist_interval``'s fields)."""

    interval_s: float
    mode: str  # auto or fixed
    persist_s: float = -1.0  # auto: the measured persist time (-1: none measured yet)
    mtbf_s: float = 0.0
    mtbf_source: str = ""

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"interval_s": round(self.interval_s, 3), "mode": self.mode}
        if self.mode == "auto":
            out |= {
                "persist_s": round(self.persist_s, 6),
                "mtbf_s": round(self.mtbf_s, 3),
                "mtbf_source": self.mtbf_source,
            }
        return out


class AutoPersist:
    """Watches storage's newest step on the master's timer (:meth:`check`) and asks persists."""

    def __init__(
        self,
        job: Job,
        steps: StepLog,
        push: Callable[[str, m.Message], None],
        config: MasterConfig,
    ) -> None:
        self.job, self.steps, self._push = job, steps, push
        self.every_s = config.persist_every_s
        self.node_mtbf_s = config.node_mtbf_s
        self.interval: Interval | None = None
        self._persists: dict[int, float] = {}  # step -> its slowest node's persist_s
        self._restarts0 = job.restart_count  # restarts before this master: not its to count
        self._node_s = 0.0  # node-seconds trained under this master
        self._ticked_at: float | None = None
        self._committed = job.last_committed
        self._durable_at: float | None = None  # when storage's newest step was committed
        self._asked: tuple[int, float, int] | None = None  # (step, when, round) in flight
        self._reached_at: float | None = None  # when every rank had saved the asked step
        self._measure_since: float | None = None  # auto: a commit seen, its persist_s not yet
        self.asked = 0  # requests sent (tests, status)

    @property
    def on(self) -> bool:
        return self.every_s != 0

    # ------------------------------------------------------------ inputs
    def persisted(self, fields: dict[str, Any]) -> None:
        """A node's ``checkpoint_persisted`` event: its persist time of the step."""
        step, seconds = fields.get("step"), fields.get("persist_s")
        if type(step) is not int or type(seconds) not in (int, float):
            return
        assert isinstance(seconds, int | float)
        if seconds < 0:
            return
        self._persists[step] = max(self._persists.get(step, 0.0), float(seconds))
        for old in sorted(self._persists)[:-PERSIST_SAMPLES]:
            del self._persists[old]

    def persist_s(self) -> float | None:
        """The median of the slowest node's persist time over the newest steps (None: none)."""
        return statistics.median(self._persists.values()) if self._persists else None

    # ------------------------------------------------------------ the timer
    def check(self) -> None:
        """On the master's timer: count the training time, note commits, ask a persist when
        storage's newest step is older than the interval."""
        if not self.on or self.job.ended:
            return
        now = self.job.clock()
        running = self.job.phase is Phase.RUNNING
        if running and self._ticked_at is not None:
            self._node_s += (now - self._ticked_at) * len(self.job.participants())
        self._ticked_at = now
        if self.job.last_committed > self._committed:
            self._committed, self._durable_at = self.job.last_committed, now
            if self.persist_s() is None:
                self._measure_since = now  # its node's persist time comes after the commit
        elif self._durable_at is None and running:
            self._durable_at = now  # training began: storage's newest step is from before
        if self._asked is not None and self._committed >= self._asked[0]:
            self._asked = None
        self._choose()
        if not running or self._durable_at is None:
            return
        if self._asked is not None and not self._give_up(now):
            return
        if self.interval is None:  # auto, no persist measured yet: measure one now
            if self._measure_since is not None and now - self._measure_since < REQUEST_TIMEOUT_S:
                return  # one committed: its time is on its way, not a reason for another
            self._ask(now, "first persist: measuring its time")
        elif now - self._durable_at >= self.interval.interval_s - self._lead_s():
            # the ranks reach the asked step about this long after the ask: it commits
            # about when storage's newest step is the interval old
            self._ask(now, f"storage's newest step is {now - self._durable_at:.1f} s old")

    def _lead_s(self) -> float:
        """How far ahead of the ranks the step is asked (seconds at the step rate)."""
        if self.interval is None:
            return ASK_AHEAD_S
        return min(ASK_AHEAD_S, ASK_AHEAD_SHARE * self.interval.interval_s)

    def _give_up(self, now: float) -> bool:
        """Whether the request in flight is given up (and forgotten): the round moved on, or
        every rank saved its step to memory a while ago and it has not committed."""
        assert self._asked is not None
        step, when, round_ = self._asked
        if round_ != self.job.round:
            why = "a new round"
        else:
            if self._reached_at is None:
                saved = self.job.saved_steps() if self.job.saved_steps is not None else None
                if saved is not None and saved[0] >= step:
                    self._reached_at = now
            timeout_s = REQUEST_TIMEOUT_S + 4 * (self.persist_s() or 0.0)
            if self._reached_at is not None and now - self._reached_at >= timeout_s:
                why = f"every rank saved it {now - self._reached_at:.1f} s ago"
            elif now - when >= REQUEST_BACKSTOP_S:
                why = f"the ranks did not save it in {now - when:.0f} s"
            else:
                return False
        log.info("persist at step=%d gave up: not committed (%s); asking a later step", step, why)
        self._asked = None
        return True

    def _choose(self) -> None:
        """The interval from what is known now; said when chosen or moved by over a tenth."""
        if self.every_s != PERSIST_AUTO:
            chosen = Interval(interval_s=self.every_s, mode="fixed")
        else:
            persist_s = self.persist_s()
            if persist_s is None:
                return
            failures = max(0, self.job.restart_count - self._restarts0)
            nodes = len(self.job.participants()) or self.job.config.nnodes.max
            mtbf = pi.job_mtbf(
                failures=failures,
                node_seconds=self._node_s,
                nodes=nodes,
                site_node_mtbf_s=self.node_mtbf_s,
            )
            chosen = Interval(
                interval_s=pi.daly_interval(persist_s, mtbf.seconds),
                mode="auto",
                persist_s=persist_s,
                mtbf_s=mtbf.seconds,
                mtbf_source=str(mtbf.source),
            )
        old = self.interval
        if (
            old is not None
            and old.mtbf_source == chosen.mtbf_source
            and not pi.changed(old.interval_s, chosen.interval_s)
        ):
            return  # the one said stays, until it moves enough
        self.interval = chosen
        log.info("persist interval %s", " ".join(f"{k}={v}" for k, v in chosen.fields().items()))
        self.job.emit(EventName.PERSIST_INTERVAL, **chosen.fields())

    def _ask(self, now: float, why: str) -> None:
        saved = self.job.saved_steps() if self.job.saved_steps is not None else None
        if saved is None or saved[0] < 0:
            return  # not every rank holds a step in memory yet: nothing to persist
        rate = self.steps.step_rate()
        if rate <= 0:
            return  # unknown yet: a step asked too close would be behind the ranks already
        # A rank already past the step by two saves is left out (the step asked again later).
        newest = max(self.steps.projected(time.time(), rate), saved[1], saved[0])
        step = stop_step(newest, rate, self._lead_s())
        notice = m.PersistStep(step=step, reason=why)
        targets = self.job.active_agents()
        if not targets:
            return
        for agent in targets:
            self._push(agent, notice)
        self._asked, self._reached_at = (step, now, self.job.round), None
        self.asked += 1
        log.info("persist at step=%d nodes=%d: %s", step, len(targets), why)
