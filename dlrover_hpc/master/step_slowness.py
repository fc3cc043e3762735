"""Stragglers counted in steps, not seconds (fail-slow within 10 s, issue 50).

Each rank reports the sums of its timed steps' compute and wait seconds
(:func:`dlrover_hpc.worker.progress.timed_at`); between two of its reports the master has the
means over *every* step the rank took, not over the one step a heartbeat happened to see.
Each check compares the ranks' newest means (:func:`dlrover_hpc.master.slowness.stragglers`,
at :func:`weak_factor`), and an episode gathers the steps of each new window that finds the
rank slow.  It is reported once it holds :func:`needed_steps` of them (fewer the slower the
rank: at 0.15 s steps a node at half speed is ~12 steps, 4 s) over two windows at least,
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
#: ... but never fewer than this, over at least this many windows that share no report.
MIN_EVIDENCE_STEPS, MIN_WINDOWS = 8, 2
#: Each check's window is the rank's newest report, and the ones before it while it holds
#: fewer steps than this.  Windows counted in an episode share no report: one long step (an
#: evaluation nobody marked, on one rank) is in one of them, and never proves anything.
WINDOW_STEPS = 3
MISSES = 2  # new windows in a row that find the rank not slow end its episode


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


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """A check's evidence of a rank: its means per step over its newest intervals."""

    compute_s: float
    wait_s: float
    steps: int
    first_at: float  # its oldest interval's report
    last_at: float  # its newest


def recent(intervals: collections.deque[Interval], now: float) -> Window | None:
    """The rank's newest intervals back to :data:`WINDOW_STEPS` steps, within
    :data:`SAMPLE_WINDOW_S`; None with fewer steps."""
    steps, compute, wait, first = 0, 0.0, 0.0, 0.0
    for iv in reversed(intervals):
        if now - iv.at > SAMPLE_WINDOW_S or steps >= WINDOW_STEPS:
            break
        steps += iv.steps
        compute += iv.compute_s * iv.steps
        wait += iv.wait_s * iv.steps
        first = iv.at
    if steps < WINDOW_STEPS:
        return None
    return Window(compute / steps, wait / steps, steps, first, intervals[-1].at)


@dataclasses.dataclass(slots=True)
class Episode:
    since: float  # the check that first found the rank slow
    counted_at: float = -math.inf  # the newest report of the windows counted (slow or not)
    steps: int = 0
    windows: int = 0
    misses: int = 0
    ratios: list[float] = dataclasses.field(default_factory=list)

    def count(self, window: Window, found: Slow | None) -> bool:
        """Counts a window that shares no report with those counted; False when the
        episode ended."""
        if window.first_at <= self.counted_at:
            return True  # nothing new
        self.counted_at = window.last_at
        if found is None:
            self.misses += 1
            return self.misses < MISSES
        self.misses = 0
        self.steps += window.steps
        self.windows += 1
        self.ratios.append(found.ratio)
        return True

    def proven(self, now: float, factor: float) -> bool:
        if self.windows < MIN_WINDOWS:
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

    def windows(self, now: float) -> dict[int, Window]:
        out = {}
        for rank, intervals in self.intervals.items():
            window = recent(intervals, now)
            if window is not None:
                out[rank] = window
        return out

    def check(
        self, now: float, factor: float
    ) -> tuple[dict[int, tuple[float, float]], dict[int, Slow], list[int]]:
        """Each check: the ranks' timings (the evidence), those found slow, and the ranks
        whose episode is proven now."""
        windows = self.windows(now)
        timings = {r: (w.compute_s, w.wait_s) for r, w in windows.items()}
        slow = stragglers(timings, weak_factor(factor))
        for rank, episode in list(self.episodes.items()):
            if rank in slow:
                continue
            if rank not in windows or not episode.count(windows[rank], None):
                del self.episodes[rank]  # the episode ended: its evidence starts again
        proven = []
        for rank, found in slow.items():
            ongoing = self.episodes.setdefault(rank, Episode(now))
            ongoing.count(windows[rank], found)
            if ongoing.proven(now, factor):
                proven.append(rank)
        return timings, slow, proven
