"""A job's goodput and where its time went, from ``events.jsonl`` alone.

:class:`Analysis` folds the log one event at a time into compact state (the master feeds it
as it writes, for its metrics; ``dlrover-hpc report`` feeds it the file) and
:meth:`Analysis.report` turns that state into a :class:`~.model.Report`.

**Goodput** = distinct training steps x the median undisturbed step time / wall time from
``job_started`` to ``job_finished`` (to the newest step while the job runs).  Steps come from
the master's ``training_progress`` events (the slowest rank's step, every few seconds); a log
without them falls back on ``checkpoint_saved``.  An *undisturbed* step time is measured
between two consecutive progress events of one round with no failure, loss, hang, admission
or master recovery between them, less the checkpoint blocking of the steps in between; the
median is taken over steps.  A step trained again after a restart counts once.

Wall time that was not useful training is charged to a :class:`~.model.Cause`: the stretches
between training (start-up, rendezvous, restarts, waiting for nodes, requeue, hangs; the
network check and restores inside them), and inside training the checkpoint blocking, the
redone steps and the remainder (steps slower than the median: stragglers, noise).  Useful
time plus every cause adds up to the wall time.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from dlrover_hpc.errors import ReportError
from dlrover_hpc.report import fields
from dlrover_hpc.report import lanes as _lanes
from dlrover_hpc.report.model import (
    Cause,
    Marker,
    NodeSummary,
    Report,
    Round,
    Stats,
    StorageStall,
)

#: events after which the next step interval is not an undisturbed one
DISTURBING = frozenset(
    {"worker_failed", "node_lost", "hang_detected", "node_admitted", "master_recovered"}
)
_WAITING = ("replacement_requested", "replacement_failed", "node_relaunched")
_MARKED = {
    "node_lost": "lost",
    "hang_detected": "hang",
    "node_drained": "drained",
    "node_quarantined": "drained",
    "node_state_changed": "drained",  # Slurm drained, failed or downed it (issue 48)
    "straggler_detected": "straggler",
}


class Analysis:
    def __init__(self) -> None:
        self.job_id = ""
        self.start: float | None = None
        self.finish: dict[str, Any] | None = None
        self.newest = 0.0  # the newest event's time
        self.rounds: list[Round] = []
        self.progress_seen = False
        self.netchecks: list[tuple[float, float]] = []  # (start, end)
        self.disturbed: list[float] = []  # times of DISTURBING events, sorted as they come
        self.gap_events: list[tuple[float, str]] = []  # hang, requeue, waiting-for-nodes
        self.failures: Counter[str] = Counter()
        self.restart_count = 0
        self.persist_s: list[float] = []
        self.restore_s: list[float] = []
        self.restores: Counter[str] = Counter()
        self.committed: dict[int, float] = {}  # step -> time of its first committed persist
        self.node_events: dict[str, list[tuple[float, str, str]]] = {}  # (time, event, detail)
        self.markers: list[tuple[float, str | None, str, str]] = []
        self.crash_loop: dict[str, Any] | None = None  # the crash_loop event, if the job had one
        #: storage stalls (persist_stalled), by (node, since): [seconds, ongoing]
        self.stalls: dict[tuple[str, float], list[Any]] = {}

    # ------------------------------------------------------------------ folding
    def add(self, e: dict[str, Any]) -> None:
        t, name = float(e["time"]), str(e["event"])
        self.newest = max(self.newest, t)
        node = e.get("node")
        match name:
            case "job_started":
                if self.start is None:
                    self.start, self.job_id = t, str(e.get("job_id", ""))
            case "job_finished":  # its count is the job's; a round's may count a pending one
                self.finish = e
                self.restart_count = int(e.get("restart_count", self.restart_count))
            case "rendezvous_complete":
                self.rounds.append(Round(int(e["round"]), t, list(e["nodes"])))
                self.restart_count = max(self.restart_count, int(e.get("restart_count", 0)))
                for rank, n in enumerate(e["nodes"]):
                    self._node(n, t, "rank", str(rank))
            case "training_progress":
                current = self._round_at(t)
                if current is not None and current.number == int(e["round"]):
                    current.progress.append((float(e.get("at") or t), int(e["step"])))
                    self.progress_seen = True
            case "checkpoint_saved":
                current = self._round_at(t)
                if current is not None:
                    step, blocking = int(e["step"]), float(e.get("blocking_s", 0.0))
                    current.blocking[step] = max(current.blocking.get(step, 0.0), blocking)
                    current.saved_at.setdefault(step, t)
            case "checkpoint_persisted":
                self.persist_s.append(float(e.get("persist_s", 0.0)))
                if e.get("committed") and int(e["step"]) not in self.committed:
                    self.committed[int(e["step"])] = t
                    self.markers.append((t, None, "checkpoint", f"step {e['step']} committed"))
            case "checkpoint_restored":
                seconds = float(e.get("restore_s", 0.0))
                self.restore_s.append(seconds)
                self.restores[str(e.get("source", "?"))] += 1
                current = self._round_at(t)
                if current is not None:
                    current.restored = max(current.restored or 0, int(e["step"]))
                    if seconds >= current.restore_s:
                        current.restore_s, current.restore_at = seconds, t
            case "restore_rejected":
                why = f"step {e['step']} rejected ({e.get('source')}): {str(e.get('why'))[:60]}"
                self.markers.append((t, node, "checkpoint", why))
            case "netcheck_result":
                self.netchecks.append((t - float(e.get("seconds", 0.0)), t))
            case "worker_failed":
                kind = str(e.get("classification", "?"))
                self.failures[kind] += 1
                self._node(node, t, name, kind)
                if kind != "peer":
                    why = e.get("signal") or f"exit {e.get('exit_code')}"
                    self.markers.append(
                        (t, node, "failure", f"rank {e.get('rank')} {why} ({kind})")
                    )
            case "job_requeued" | "replacement_requested" | "replacement_failed":
                self.gap_events.append((t, "requeue" if name == "job_requeued" else "waiting"))
                if name == "job_requeued":
                    self.markers.append((t, None, "requeue", str(e.get("reason", ""))[:80]))
            case "crash_loop":
                self.crash_loop = e
            case "persist_stalled":
                seconds = float(e["seconds"])
                since = float(e.get("since") or t - seconds)
                key = (str(node or "?"), round(since, 1))
                if key not in self.stalls:
                    self.markers.append(
                        (since, node, "storage", f"storage stalled ({e.get('path', '?')})")
                    )
                stall = self.stalls.setdefault(key, [0.0, True])
                stall[0] = max(stall[0], seconds)
                stall[1] = stall[1] and bool(e.get("ongoing"))
                if not e.get("ongoing"):
                    self.markers.append(
                        (t, node, "storage", f"storage answered after {seconds:.0f} s")
                    )
            case "master_recovered":
                self.markers.append((t, None, "master", f"downtime {e.get('downtime_s')} s"))
            case _:
                pass
        if name == "hang_detected":
            self.gap_events.append((t, "hang"))
            node = e.get("suspected_node")
        if name == "node_relaunched":
            self.gap_events.append((t, "waiting"))
        if name in DISTURBING:
            self.disturbed.append(t)
        if name in _MARKED:
            self.markers.append((t, node, _MARKED[name], str(e.get("reason") or e.get("why", ""))))
        if node and name in _lanes.NODE_EVENTS:
            detail = e.get("reason") or e.get("why") or ""
            self._node(node, t, name, str(detail)[:120])

    def _node(self, node: str | None, t: float, name: str, detail: str) -> None:
        if node:
            self.node_events.setdefault(node, []).append((t, name, detail))

    def _round_at(self, t: float) -> Round | None:
        return self.rounds[-1] if self.rounds and self.rounds[-1].time <= t else None

    # ------------------------------------------------------------------ the report
    def report(self, now: float | None = None, *, lanes: bool = True) -> Report:
        """``now``: the end of a running job's wall when it is not training; ``lanes``: each
        node's spans too (the plot, the node table's last state)."""
        if self.start is None:
            raise ReportError("the event log has no job_started event: is it a job's events.jsonl?")
        start = self.start
        for r in self.rounds:  # a log without progress reports: the saves are the steps
            r.samples = (
                r.progress if self.progress_seen else sorted((t, s) for s, t in r.saved_at.items())
            )
        ideal = self._ideal_step()
        end = self._end(now)
        wall = max(0.0, end - start)
        steps, redone, stretches = self._steps(ideal)
        training = sum(b - a for _, a, b in stretches)
        lost: dict[Cause, float] = dict.fromkeys(Cause, 0.0)
        for cause, seconds in self._gaps(start, end, [(a, b) for _, a, b in stretches]).items():
            lost[cause] += seconds
        blocking = sum(
            v for r in self.rounds for s, v in r.blocking.items() if _trained(r, s, stretches)
        )
        lost[Cause.CHECKPOINT_BLOCKING] = blocking
        lost[Cause.REDONE_STEPS] = redone * ideal
        lost[Cause.SLOW_STEPS] = training - steps * ideal - blocking - redone * ideal
        spans = (
            _lanes.spans(
                self.rounds, self.netchecks, self.node_events, self.finish, start, end, stretches
            )
            if lanes
            else []
        )
        return Report(
            job_id=self.job_id,
            finished=self.finish is not None,
            exit_code=None if self.finish is None else int(self.finish.get("exit_code", 0)),
            wall_s=round(wall, 3),
            goodput=round(steps * ideal / wall, 4) if wall > 0 else 0.0,
            steps=steps,
            redone_steps=redone,
            ideal_step_s=round(ideal, 6),
            training_s=round(training, 3),
            lost_s={c: round(v, 3) for c, v in lost.items()},
            rounds=len(self.rounds),
            restarts=self.restart_count,
            membership_changes=sum(
                set(a.nodes) != set(b.nodes) for a, b in itertools.pairwise(self.rounds)
            ),
            failures=dict(self.failures),
            checkpoint_save=Stats.of([v for r in self.rounds for v in r.blocking.values()]),
            checkpoint_persist=Stats.of(self.persist_s),
            checkpoint_restore=Stats.of(self.restore_s),
            restores=dict(self.restores),
            last_checkpoint_step=max(self.committed, default=None),
            nodes=self._nodes(spans),
            repeated_failure=repeated_failure(self.crash_loop),
            storage_stalls=[
                StorageStall(node, round(since - start, 3), round(v[0], 3), bool(v[1]))
                for (node, since), v in sorted(self.stalls.items(), key=lambda kv: kv[0][1])
            ],
            spans=spans,
            markers=[
                Marker(round(t - start, 3), node, kind, label)
                for t, node, kind, label in sorted(self.markers, key=lambda m: m[0])
                if t <= end
            ],
        )

    def _end(self, now: float | None) -> float:
        if self.finish is not None:
            return float(self.finish["time"])
        newest_step = max((r.samples[-1][0] for r in self.rounds if r.samples), default=None)
        disturbed_since = newest_step is not None and any(t > newest_step for t in self.disturbed)
        if newest_step is not None and not disturbed_since:
            return newest_step  # training: the wall runs to its newest step
        return now if now is not None else self.newest

    def _ideal_step(self) -> float:
        """The median over steps of undisturbed step times (blocking taken out)."""
        weighted: list[tuple[float, int]] = []
        for r in self.rounds:
            for (t0, s0), (t1, s1) in itertools.pairwise(r.samples[1:]):  # not from the first
                if s1 <= s0 or t1 <= t0 or self._disturbed_between(t0, t1):
                    continue
                blocked = sum(v for s, v in r.blocking.items() if s0 < s <= s1)
                weighted.append((max(0.0, t1 - t0 - blocked) / (s1 - s0), s1 - s0))
        if not weighted:
            return 0.0
        weighted.sort()
        half, seen = sum(w for _, w in weighted) / 2, 0
        for value, w in weighted:
            seen += w
            if seen >= half:
                return value
        return weighted[-1][0]

    def _disturbed_between(self, t0: float, t1: float) -> bool:
        i = bisect.bisect_right(self.disturbed, t0)
        return i < len(self.disturbed) and self.disturbed[i] <= t1

    def _steps(self, ideal: float) -> tuple[int, int, list[tuple[Round, float, float]]]:
        """Distinct steps, steps trained again, and each round's training stretch.

        A round that restored step ``R`` proves the rounds before it trained (and kept) every
        step up to ``R``, also past their newest progress report: those count, and the
        previous round's stretch runs on to about when it reached ``R``."""
        frontier: int | None = None
        useful = redone = 0
        stretches = []
        for i, r in enumerate(self.rounds):
            if r.restored is not None and frontier is not None and r.restored > frontier:
                useful += r.restored - frontier
                frontier = r.restored
            if not r.samples:
                continue
            first_step = r.samples[0][1]
            begin = first_step if frontier is not None else 0
            if r.restored is not None:
                begin = r.restored
            last = r.samples[-1][1]
            done = frontier if frontier is not None else begin
            useful += max(0, last - max(done, begin))
            redone += max(0, min(last, done) - begin)
            frontier = max(done, last)
            moved = [(t, s) for t, s in r.samples if s > first_step]
            if not moved:
                continue
            t1, s1 = moved[0]
            began = max(r.samples[0][0], t1 - (s1 - max(begin, first_step)) * ideal)
            t_last = r.samples[-1][0]
            ended = t_last
            after = self.rounds[i + 1] if i + 1 < len(self.rounds) else None
            if after is not None and after.restored is not None and after.restored > last:
                j = bisect.bisect_right(self.disturbed, t_last)
                stop = self.disturbed[j] if j < len(self.disturbed) else after.time
                ended = min(stop, after.time, t_last + (after.restored - last) * ideal)
            stretches.append((r, min(began, t1), max(t_last, ended)))
        return useful, redone, stretches

    def _gaps(
        self, start: float, end: float, training: list[tuple[float, float]]
    ) -> dict[Cause, float]:
        """Time between training stretches, by cause (see the module's docstring)."""
        paint = _lanes.Painter(start, end)
        bounds = [start, *[x for ab in training for x in ab], end]
        gaps = [(a, b) for a, b in zip(bounds[::2], bounds[1::2], strict=True) if b > a]
        for i, (a, b) in enumerate(gaps):
            last_gap = i == len(gaps) - 1 and (not training or a >= training[-1][1])
            if a == start:
                paint.add(a, b, Cause.START_UP)
                continue
            if last_gap and self.finish is not None and not self._disturbed_between(a, b):
                paint.add(a, b, Cause.SHUTDOWN)
                continue
            paint.add(a, b, Cause.RESTARTS)
            formed = [r.time for r in self.rounds if a <= r.time <= b]
            if formed:
                paint.add(a, formed[-1], Cause.RENDEZVOUS)
            until = formed[-1] if formed else b
            for t, kind in self.gap_events:
                if a <= t <= b and kind == "waiting":
                    paint.add(t, until, Cause.WAITING_FOR_NODES)
            for t, kind in self.gap_events:
                if a <= t <= b and kind == "requeue":
                    paint.add(t, until, Cause.REQUEUE)
                if a <= t <= b and kind == "hang":
                    paint.add(a, t, Cause.HANGS)
            for c0, c1 in self.netchecks:
                paint.add(max(a, c0), min(b, c1), Cause.NETWORK_CHECK)
            for r in self.rounds:
                if r.restore_s and a <= r.restore_at <= b:
                    paint.add(max(a, r.restore_at - r.restore_s), r.restore_at, Cause.RESTORE)
        for c0, c1 in self.netchecks:  # the first check runs inside the start-up
            paint.add(max(start, c0), min(bounds[1], c1), Cause.NETWORK_CHECK)
        return paint.totals()

    def _nodes(self, spans: list[Any]) -> list[NodeSummary]:
        final = {s.node: s.state for s in spans}
        places = [(r.number, {n: i for i, n in enumerate(r.nodes)}) for r in self.rounds]
        out = []
        for node, evs in self.node_events.items():
            ranks = {number: at[node] for number, at in places if node in at}
            removed = ""
            for _, name, detail in evs:
                if name in ("node_drained", "node_quarantined"):
                    removed = f"{name.removeprefix('node_')}: {detail}"
                elif name == "node_state_changed":
                    removed = f"slurm: {detail}"
                if name == "node_unhealthy" and not removed:  # drained after it: says both
                    removed = f"unhealthy: {detail}"
            out.append(
                NodeSummary(
                    node=node,
                    ranks=ranks,
                    failures=dict(Counter(d for _, n, d in evs if n == "worker_failed")),
                    lost=sum(1 for _, n, _ in evs if n == "node_lost"),
                    removed=removed,
                    admitted=sum(1 for _, n, _ in evs if n in ("node_admitted", "node_readmitted")),
                    state=final.get(node),
                )
            )
        first = {n.node: min(n.ranks.items())[1] if n.ranks else 1 << 30 for n in out}
        return sorted(out, key=lambda n: (first[n.node], n.node))  # the first round's order


def _trained(r: Round, step: int, stretches: list[tuple[Round, float, float]]) -> bool:
    """A save inside the round's training stretch (not one made while starting up)."""
    return any(x is r and a <= r.saved_at.get(step, a) <= b for x, a, b in stretches)


def read_events(path: str | Path) -> Iterable[dict[str, Any]]:
    """The events of ``path``; a torn last line (a writer died mid-line) is skipped, and so is
    a torn line that a master sealed (its ``log_repaired`` event names it); any other bad line
    is an error naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()  # bytes: orjson reads them as they are
    except FileNotFoundError:
        raise ReportError(
            f"{path} does not exist; pass --job-dir with a job's directory "
            "(SUBMIT_DIR/.dlrover-hpc/JOB_ID)"
        ) from None
    except IsADirectoryError:
        raise ReportError(
            f"{path} is a directory, not an event log; pass --job-dir with the job's directory "
            "(SUBMIT_DIR/.dlrover-hpc/JOB_ID) or its events.jsonl"
        ) from None
    events: list[dict[str, Any]] = []
    bad: list[tuple[int, str]] = []
    with collector_paused():
        wrong = _parse(lines, events, bad)
    sealed = {
        e.get("line") for e in events if e["event"] == "log_repaired" and e.get("file") == path.name
    }
    for number, why in bad:
        if wrong is not None and wrong[0] < number:
            break
        if number not in sealed:
            raise ReportError(
                f"{path}:{number}: not an event ({why}); fix: every line must be a JSON object "
                "with 'time' and 'event': restore the file or remove the line"
            )
    if wrong is not None:
        raise ReportError(f"{path}:{wrong[0]}: {wrong[1]}")
    return events


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while a log's million small objects are built (none of
    them in a cycle): each collection would walk every one built so far (an 8-hour log of
    4,096 nodes: read and analysed in 4.4 s, not 7.9)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _parse(
    lines: list[bytes], events: list[dict[str, Any]], bad: list[tuple[int, str]]
) -> tuple[int, str] | None:
    """Fill ``events`` and ``bad`` (lines that are not JSON objects); return the first line
    whose fields have the wrong types (:mod:`.fields`), with what is wrong."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            try:
                event = orjson.loads(line)  # a fourth of json's time: logs of 100s of MB
            except orjson.JSONDecodeError:
                # What orjson refuses and json reads: NaN, bytes that are not UTF-8 (replaced)
                event = json.loads(line.decode(errors="replace"))
            if not isinstance(event, dict) or "time" not in event or "event" not in event:
                raise ValueError("not an object with 'time' and 'event'")
        except ValueError as exc:
            if number < len(lines):  # the last line may be torn: its writer died mid-line
                bad.append((number, str(exc)))
            continue
        wrong = fields.problem(event)
        if wrong is not None:
            return number, wrong
        events.append(event)
    return None


def analyze(events: Iterable[dict[str, Any]], now: float | None = None) -> Report:
    analysis = Analysis()
    with collector_paused():
        for e in sorted(events, key=lambda e: float(e["time"])):
            analysis.add(e)
        return analysis.report(now)


def repeated_failure(e: dict[str, Any] | None) -> str:
    """A crash loop's line: how many rounds, and the failure that repeated ("" if none)."""
    if e is None:
        return ""
    return (
        f"{e.get('rounds')} rounds in a row failed without progress, first on rank {e.get('rank')} "
        f"of {e.get('node')} ({e.get('classification')}): {e.get('error')}"
    )
