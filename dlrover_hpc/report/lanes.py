"""Each node's lane over the wall time (the timeline plot), and interval painting (the lost-time
causes): both cut the wall into pieces at every event and label each piece."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

from dlrover_hpc.report.model import LaneState, Round, Span

#: node events that change a node's lane (besides its ranks in each round and its failures)
NODE_EVENTS = frozenset(
    {
        "node_joined",
        "node_lost",
        "node_drained",
        "node_quarantined",
        "node_state_changed",
        "node_admitted",
        "node_readmitted",
        "node_relaunched",
        "straggler_detected",
        "node_unhealthy",
    }
)
_OUT = {"node_lost": LaneState.LOST, "node_drained": LaneState.DRAINED}
_OUT["node_quarantined"] = LaneState.DRAINED
_OUT["node_unhealthy"] = LaneState.DRAINED  # failed its health check: never trains
_BACK = frozenset({"node_joined", "node_readmitted", "node_admitted", "rank"})


class Painter:
    """Labels over ``[start, end]``; a label added later wins where labels overlap."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self._layers: list[tuple[float, float, Any]] = []

    def add(self, a: float, b: float, label: Any) -> None:
        a, b = max(a, self.start), min(b, self.end)
        if b > a:
            self._layers.append((a, b, label))

    def pieces(self) -> list[tuple[float, float, Any]]:
        cuts = sorted({self.start, self.end, *[x for a, b, _ in self._layers for x in (a, b)]})
        labels: list[Any] = [None] * (len(cuts) - 1)
        for a, b, label in self._layers:  # in order: later layers overwrite
            for i in range(bisect.bisect_left(cuts, a), bisect.bisect_left(cuts, b)):
                labels[i] = label
        return [(cuts[i], cuts[i + 1], lab) for i, lab in enumerate(labels) if lab is not None]

    def totals(self) -> dict[Any, float]:
        out: dict[Any, float] = {}
        for a, b, label in self.pieces():
            out[label] = out.get(label, 0.0) + (b - a)
        return out


def spans(
    rounds: Sequence[Round],
    netchecks: Sequence[tuple[float, float]],
    node_events: dict[str, list[tuple[float, str, str]]],
    finish: dict[str, Any] | None,
    start: float,
    end: float,
    stretches: Sequence[tuple[Round, float, float]],
) -> list[Span]:
    """Every node's lane from its first event to ``end``, relative to ``start``."""
    round_times = [r.time for r in rounds]
    members = [frozenset(r.nodes) for r in rounds]  # not a list's scan per lane and cut
    trained = {id(r): (a, b) for r, a, b in stretches}
    job_cuts = {start, end, *round_times, *[x for _, a, b in stretches for x in (a, b)]}
    for c0, c1 in netchecks:
        job_cuts |= {c0, c1}
    out: list[Span] = []
    for node, events in node_events.items():
        events = sorted(events, key=lambda e: e[0])
        first = max(start, events[0][0])
        times = [t for t, _, _ in events]
        cuts = sorted(x for x in job_cuts | set(times) if first <= x <= end)
        current: Span | None = None
        for x, y in itertools.pairwise(cuts):
            mid = (x + y) / 2
            state = _state_at(
                node, mid, events, times, rounds, round_times, members, trained, netchecks, finish
            )
            if state is None:
                continue
            if current is not None and current.state is state and current.end == x - start:
                current = Span(node, current.start, y - start, state)
                out[-1] = current
            else:
                current = Span(node, round(x - start, 3), round(y - start, 3), state)
                out.append(current)
    return out


def _state_at(
    node: str,
    t: float,
    events: list[tuple[float, str, str]],
    times: list[float],
    rounds: Sequence[Round],
    round_times: list[float],
    members: list[frozenset[str]],
    trained: dict[int, tuple[float, float]],
    netchecks: Sequence[tuple[float, float]],
    finish: dict[str, Any] | None,
) -> LaneState | None:
    out: LaneState | None = None
    for _, name, _ in events[: bisect.bisect_right(times, t)]:
        if name in _OUT:
            out = _OUT[name]
        elif name in _BACK:
            out = None
    if out is not None:
        return out
    if any(c0 <= t <= c1 for c0, c1 in netchecks):
        return LaneState.CHECK
    i = bisect.bisect_right(round_times, t) - 1
    if i < 0:
        return LaneState.RENDEZVOUS
    r, last = rounds[i], i == len(rounds) - 1
    stretch = trained.get(id(r))
    over = stretch is not None and t > stretch[1]  # the round trained and stopped
    if over and not last:
        return LaneState.RENDEZVOUS  # every node waits for the next round
    if node not in members[i]:
        return LaneState.SPARE
    if stretch is None or t < stretch[0]:
        return LaneState.RESTARTING  # its workers starting (or failing before they trained)
    if not over or (finish is not None and not finish.get("exit_code")):
        return LaneState.TRAINING  # (after the newest step: the last steps, the exits)
    return LaneState.RENDEZVOUS
