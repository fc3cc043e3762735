"""What ``dlrover-hpc report`` tells about a job: plain values, built by :mod:`.analysis` from
``events.jsonl`` alone and drawn by :mod:`.table` (terminal) and :mod:`.plot` (a PNG).

Times are seconds since the job started (``job_started``), unless a name says otherwise.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class LaneState(enum.StrEnum):
    """What a node was doing; one colour each in the timeline plot."""

    TRAINING = "training"
    RENDEZVOUS = "rendezvous"  # waiting for the next round to form
    CHECK = "check"  # the pairwise network check
    RESTARTING = "restarting"  # the round formed; its workers not training yet (start, restore)
    SPARE = "idle spare"  # joined, not in the running round
    LOST = "lost"  # the master gave it up (crash, cut link, killed agent)
    DRAINED = "drained"  # drained or quarantined as faulty


class Cause(enum.StrEnum):
    """Where wall time that was not useful training went (the report's lost-time table)."""

    START_UP = "start-up"  # job start to the first training step, less the network check
    RENDEZVOUS = "rendezvous"  # a failure or a membership change to the next round's start
    NETWORK_CHECK = "network check"
    RESTARTS = "restarts"  # the next round formed to its first training step, less restore
    HANGS = "hangs"  # the newest step before a detected hang to the detection
    WAITING_FOR_NODES = "waiting for nodes"  # replacements requested or nodes relaunched
    REQUEUE = "requeue"  # the job was requeued: a new allocation
    CHECKPOINT_BLOCKING = "checkpoint blocking"  # training paused while state went to memory
    RESTORE = "restore"
    REDONE_STEPS = "redone steps"  # steps trained again after a restart (rolled back)
    SLOW_STEPS = "slow steps"  # training time beyond the median step (stragglers, noise; +-)
    SHUTDOWN = "shutdown"  # the last step to job_finished (final persist, exits)


@dataclasses.dataclass(slots=True)
class Round:
    """One rendezvous round as the analysis sees it (wall clock times)."""

    number: int
    time: float  # rendezvous_complete
    nodes: list[str]
    progress: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (at, step)
    restored: int | None = None  # the newest step its ranks restored
    restore_s: float = 0.0  # its slowest rank's restore
    restore_at: float = 0.0
    blocking: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> slowest rank
    samples: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # set by report
    saved_at: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> first save


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    node: str
    start: float
    end: float
    state: LaneState


@dataclasses.dataclass(frozen=True, slots=True)
class Marker:
    time: float
    node: str | None  # None: the whole job (a committed checkpoint, a requeue)
    kind: str  # failure | lost | hang | drained | straggler | checkpoint | requeue | master
    label: str  # | storage


@dataclasses.dataclass(frozen=True, slots=True)
class StorageStall:
    """A time a node's persist got no answer from storage (``persist_stalled``)."""

    node: str
    start: float  # seconds since the job started
    seconds: float
    ongoing: bool  # not over when the log ends


@dataclasses.dataclass(frozen=True, slots=True)
class Stats:
    """Seconds of one kind of checkpoint operation."""

    count: int
    median: float
    p95: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        if not values:
            return cls(0, 0.0, 0.0, 0.0)
        ordered = sorted(values)
        return cls(
            count=len(ordered),
            median=round(_quantile(ordered, 0.5), 4),
            p95=round(_quantile(ordered, 0.95), 4),
            max=round(ordered[-1], 4),
        )


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclasses.dataclass(frozen=True, slots=True)
class NodeSummary:
    node: str
    ranks: dict[int, int]  # round -> the node's rank in it
    failures: dict[str, int]  # classification -> worker failures reported on it
    lost: int  # times the master gave it up
    removed: str  # "drained" | "quarantined" | "" (its newest removal, with the reason)
    admitted: int  # times it joined a running job (spare, replacement, re-admitted)
    state: LaneState | None  # at the end of the report


@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    job_id: str
    finished: bool
    exit_code: int | None
    wall_s: float
    goodput: float  # useful steps x ideal step time / wall
    steps: int  # distinct steps trained (a step trained again after a restart counts once)
    redone_steps: int
    ideal_step_s: float  # median undisturbed step time (checkpoint blocking taken out)
    training_s: float  # time inside training stretches
    lost_s: dict[Cause, float]  # wall - useful time, by cause; sums with useful to the wall
    rounds: int
    restarts: int  # worker restarts charged to the job's --max-restarts
    membership_changes: int  # rounds whose nodes differ from the round before
    failures: dict[str, int]  # classification -> worker failures
    checkpoint_save: Stats  # blocking seconds per save (the slowest rank of each step)
    checkpoint_persist: Stats
    checkpoint_restore: Stats
    restores: dict[str, int]  # source (memory | peer | storage) -> ranks restored from it
    last_checkpoint_step: int | None  # newest committed (persisted) step
    nodes: list[NodeSummary]  # by rank in their first round, then by name
    #: the job stopped as a crash loop (crash_loop): the rounds and the failure that repeated
    repeated_failure: str = ""
    storage_stalls: list[StorageStall] = dataclasses.field(default_factory=list)
    spans: list[Span] = dataclasses.field(default_factory=list)
    markers: list[Marker] = dataclasses.field(default_factory=list)

    @property
    def useful_s(self) -> float:
        return self.steps * self.ideal_step_s

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (``report --json``): enums as their values, spans and markers included."""
        out = dataclasses.asdict(self)
        out["lost_s"] = {str(k): v for k, v in self.lost_s.items()}
        out["useful_s"] = round(self.useful_s, 3)
        for n in out["nodes"]:
            n["state"] = None if n["state"] is None else str(n["state"])
        out["spans"] = [
            {"node": s.node, "start": s.start, "end": s.end, "state": str(s.state)}
            for s in self.spans
        ]
        return out
