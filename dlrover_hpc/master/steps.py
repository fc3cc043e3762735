"""The job's training step, from the progress the agents report with every heartbeat.

The master writes it to the event log as ``training_progress`` (round, step, ``at``: the wall
time the step finished), so the goodput report and the metrics need nothing but the log.  The
job's step is its slowest rank's (data-parallel ranks move together; a pipeline's last stage
is the one that finishes a step).  A round's first report is always written (the step its
workers started from), then at most one every :data:`EVERY_S` seconds of training, and the
last one when the workers succeed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dlrover_hpc.events import EventName
from dlrover_hpc.protocol import messages as m

#: seconds of training between two training_progress events of one round
EVERY_S = 5.0
#: the reports of a round give its step rate once they span this many seconds
RATE_SPAN_S = 1.0
#: the slowest rank (a pass over every rank) is looked for at most this often, in the steps'
#: own time, not at every heartbeat: at 4,096 nodes x 8 ranks, 2,048 heartbeats a second
#: would each pass over 32,768 ranks
EVAL_EVERY_S = 0.5


class StepLog:
    def __init__(self, emit: Callable[..., None], *, every_s: float = EVERY_S) -> None:
        self._emit = emit
        self.every_s = every_s
        self.round = -1
        self._ranks: dict[int, tuple[int, float]] = {}  # rank -> (step, at)
        # node -> its ranks, and its slowest rank's (step, at): the slowest rank of the round
        # is the slowest of 4,096 nodes', not of 32,768 ranks'
        self._node_ranks: dict[str, set[int]] = {}
        self._node_min: dict[str, tuple[int, float]] = {}
        self.node_steps: dict[str, int] = {}  # node -> its slowest rank's step (status)
        self._written: tuple[int, float] | None = None  # the round's newest event: (step, at)
        self.samples: list[tuple[float, int]] = []  # (at, step) written, newest last (metrics)
        # the round's slowest rank, first and newest seen with every rank reported: the rate
        # before two events are written (a stop early in a round needs it)
        self._first: tuple[int, float] | None = None
        self._latest: tuple[int, float] | None = None
        self._looked_at = 0.0  # the newest step time reported when the slowest was looked for

    def report(
        self,
        *,
        node: str,
        round: int,
        world_size: int,
        progress: Sequence[m.RankProgress],
        final: bool = False,
    ) -> None:
        """One agent's ranks; ``final``: its workers succeeded, nothing newer will come."""
        if round != self.round:
            if round < self.round:
                return  # a late report of a round that is over
            self.round, self._ranks, self._written = round, {}, None
            self._node_ranks, self._node_min = {}, {}
            self.node_steps, self._first, self._latest = {}, None, None
            self._looked_at = 0.0
        known = [p for p in progress if p.at > 0]
        ranks = self._ranks
        for p in known:
            ranks[p.rank] = (p.step, p.at)
        if known:
            self.node_steps[node] = min(p.step for p in known)
            mine = self._node_ranks.setdefault(node, set())
            mine.update(p.rank for p in known)
            self._node_min[node] = min(ranks[r] for r in mine)
        if len(self._ranks) < world_size:
            return  # the round's step is its slowest rank's: wait until every rank reported
        reported = max((p.at for p in known), default=0.0)
        if not final and self._first is not None and reported - self._looked_at < EVAL_EVERY_S:
            return
        self._looked_at = max(self._looked_at, reported)
        step, at = min(self._node_min.values())
        self._first = self._first or (step, at)
        self._latest = (step, at)
        written = self._written
        if written is not None and (step <= written[0] or at <= written[1]):
            return
        if written is None or final or at - written[1] >= self.every_s:
            self._write(step, at)

    def _write(self, step: int, at: float) -> None:
        self._written = (step, at)
        self.samples.append((at, step))
        del self.samples[:-2]
        self._emit(EventName.TRAINING_PROGRESS, round=self.round, step=step, at=round(at, 3))

    def step_rate(self) -> float:
        """Steps per second between the two newest events; before there are two, over the
        round's reports so far, once they span ``RATE_SPAN_S`` (0 when unknown)."""
        if len(self.samples) >= 2:
            (t0, s0), (t1, s1) = self.samples
            return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 >= s0 else 0.0
        if self._first is None or self._latest is None:
            return 0.0
        (s0, t0), (s1, t1) = self._first, self._latest
        return (s1 - s0) / (t1 - t0) if t1 - t0 >= RATE_SPAN_S and s1 >= s0 else 0.0

    def projected(self, now: float, rate: float) -> int:
        """The furthest rank's step at wall time ``now``: its newest report's, plus the steps
        ``rate`` (steps a second) makes since (-1: none reported)."""
        return max(
            (step + int(rate * max(0.0, now - at)) for step, at in self._ranks.values()),
            default=-1,
        )

    @property
    def newest(self) -> int:
        """The furthest rank's newest step in the running round (-1: none reported)."""
        return max((step for step, _ in self._ranks.values()), default=-1)

    @property
    def step(self) -> int:
        """The newest step written (-1: none yet)."""
        return self.samples[-1][1] if self.samples else -1
