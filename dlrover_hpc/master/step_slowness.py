"""Stragglers counted in steps, not seconds (fail-slow within 10 s, issue 50).

Each rank reports the sums of its timed steps' compute and wait seconds
(:func:`dlrover_hpc.worker.progress.timed_at`); between two of its reports the master has the
means over *every* step the rank took, not over the one step a heartbeat happened to see.
Each check compares the ranks' newest means (:func:`dlrover_hpc.master.slowness.stragglers`,
at :func:`weak_factor`), and an episode gathers the steps of each new interval that finds the
rank slow.  It is reported once it holds :func:`needed_steps` of them (fewer the slower the
rank: at 0.15 s steps a node at half speed is ~12 steps, 4 s) over two heartbeats at least,
or once it lasted :func:`dlrover_hpc.master.slowness.evidence_window` (the old rule in
seconds, for jobs whose steps are long).  Agents that report no sums give one step per report.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics

from dlrover_hpc.master.slowness import SAMPLE_WINDOW_S, Slow, evidence_window, stragglers

#: A rank this far past 1 towards ``--straggler-factor`` (1.4 for the default 2) is a
#: candidate: a node at 2/3 speed computes 1.5x its peers, and must be found too (in 20 s).
WEAK_SHARE = 0.4
#: The steps an episode needs at the weak factor; k times as far past 1, k times fewer ...
EVIDENCE_STEPS = 30
#: ... but never fewer than this, over at least this many of the rank's reports.
MIN_EVIDENCE_STEPS, MIN_INTERVALS = 8, 2
#: Each check's mean covers the rank's newest reports back to this many steps (a rank at a
#: quarter speed takes ~5 steps between two heartbeats of 2 s), and needs this many at least.
RECENT_STEPS, MIN_RECENT_STEPS = 5, 3
MISSES = 2  # new reports in a row that find the rank not slow end its episode


@dataclasses.dataclass(frozen=True, slots=True)
class Interval:
    """The means per step of a rank's steps between two of its reports (at: the newer)."""

    at: float
    steps: int
    compute_s: float
    wait_s: float


def weak_factor(factor: float) -> float:
    return 1.0 + (factor - 1.0) * WEAK_SHARE


def needed_steps(ratios: list[float], factor: float) -> int:
    """Steps of evidence an episode needs, from the median of its intervals' ratios."""
    bar = weak_factor(factor) - 1.0
    excess = statistics.median(ratios) - 1.0 if ratios else 0.0
    if excess <= 0:
        return 1 << 30
    return max(MIN_EVIDENCE_STEPS, math.ceil(EVIDENCE_STEPS * bar / excess))


def interval(
    before: tuple[int, float, float] | None, after: tuple[int, float, float], at: float
) -> Interval | None:
    """The interval between two reports of (timed steps, compute sum, wait sum); None when
    no step was timed between them, or the counts started again (a new process)."""
    if before is None or after[0] <= before[0]:
        return None
    n = after[0] - before[0]
    return Interval(at, n, (after[1] - before[1]) / n, max(0.0, after[2] - before[2]) / n)


def recent(intervals: collections.deque[Interval], now: float) -> tuple[float, float] | None:
    """The rank's mean compute and wait per step over its newest intervals (back to
    :data:`RECENT_STEPS` steps, within :data:`SAMPLE_WINDOW_S`); None with too few steps."""
    steps, compute, wait = 0, 0.0, 0.0
    for iv in reversed(intervals):
        if now - iv.at > SAMPLE_WINDOW_S or steps >= RECENT_STEPS:
            break
        steps += iv.steps
        compute += iv.compute_s * iv.steps
        wait += iv.wait_s * iv.steps
    if steps < MIN_RECENT_STEPS:
        return None
    return compute / steps, wait / steps


@dataclasses.dataclass(slots=True)
class Episode:
    since: float  # the check that first found the rank slow
    counted_at: float = -math.inf  # the newest interval counted (slow or not)
    steps: int = 0
    intervals: int = 0
    misses: int = 0
    ratios: list[float] = dataclasses.field(default_factory=list)

    def count(self, intervals: collections.deque[Interval], found: Slow | None) -> bool:
        """Counts the intervals newer than the last counted; False when the episode ended."""
        new = [iv for iv in intervals if iv.at > self.counted_at]
        if not new:
            return True
        self.counted_at = new[-1].at
        if found is None:
            self.misses += 1
            return self.misses < MISSES
        self.misses = 0
        self.steps += sum(iv.steps for iv in new)
        self.intervals += len(new)
        self.ratios.append(found.ratio)
        return True

    def proven(self, now: float, factor: float) -> bool:
        if self.intervals < MIN_INTERVALS:
            return False
        if self.steps >= needed_steps(self.ratios, factor):
            return True
        return now - self.since >= evidence_window(self.ratios, factor)


class StepSlowness:
    """The ranks' intervals and episodes in the running round."""

    def __init__(self) -> None:
        self.intervals: dict[int, collections.deque[Interval]] = {}
        self._totals: dict[int, tuple[int, float, float]] = {}
        self.episodes: dict[int, Episode] = {}

    def clear(self) -> None:
        self.intervals.clear()
        self._totals.clear()
        self.episodes.clear()

    def report(
        self,
        rank: int,
        at: float,
        *,
        totals: tuple[int, float, float],
        step: tuple[float, float] | None,
    ) -> None:
        """A rank's report: its ``totals`` (0 steps: an agent that sends none, then
        ``step``: its newest step's compute and wait, once per new step, is one interval)."""
        if totals[0] > 0:
            found = interval(self._totals.get(rank), totals, at)
            self._totals[rank] = totals
        else:
            found = Interval(at, 1, *step) if step is not None else None
        if found is not None:
            self.intervals.setdefault(rank, collections.deque(maxlen=16)).append(found)

    def timings(self, now: float) -> dict[int, tuple[float, float]]:
        out = {}
        for rank, intervals in self.intervals.items():
            mean = recent(intervals, now)
            if mean is not None:
                out[rank] = mean
        return out

    def check(
        self, now: float, factor: float
    ) -> tuple[dict[int, tuple[float, float]], dict[int, Slow], list[int]]:
        """Each check: the ranks' timings (the evidence), those found slow, and the ranks
        whose episode is proven now."""
        timings = self.timings(now)
        slow = stragglers(timings, weak_factor(factor))
        for rank, episode in list(self.episodes.items()):
            if rank not in slow and not episode.count(self.intervals[rank], None):
                del self.episodes[rank]  # the episode ended: its evidence starts again
        proven = []
        for rank, found in slow.items():
            episode = self.episodes.get(rank)
            if episode is None:  # its newest interval is the first evidence, no older one
                episode = self.episodes[rank] = Episode(now)
                newest = self.intervals[rank][-1]
                episode.counted_at = newest.at - 1e-9
            episode.count(self.intervals[rank], found)
            if episode.proven(now, factor):
                proven.append(rank)
        return timings, slow, proven
