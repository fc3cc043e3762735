"""The rendezvous decision, as a pure function of who waits and what time it is.

The master calls :func:`decide` whenever the waiting set changes or a timer fires, and applies
the returned :class:`Decision` itself (the I/O lives in ``dlrover_hpc.master``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from enum import Enum

from dlrover_hpc.errors import ConfigError
from dlrover_hpc.rendezvous.segments import Candidate, choose_segments, segment_capacity


class DecisionKind(Enum):
    WAIT = "wait"  # not enough nodes yet, or inside the last call
    COMPLETE = "complete"  # start the round with ``chosen``
    TIMEOUT = "timeout"  # fewer than MIN nodes for longer than the rendezvous timeout


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RdzvParams:
    min_nodes: int
    max_nodes: int
    node_unit: int = 1
    last_call_s: float = 3.0
    timeout_s: float = 600.0
    #: nodes of one segment (``--segment``): a round takes whole segments, each in one block
    segment: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(
                f"rendezvous needs 1 <= MIN <= MAX, got {self.min_nodes}:{self.max_nodes}"
            )
        if self.node_unit < 1:
            raise ConfigError(f"node unit must be at least 1, got {self.node_unit}")
        if self.segment < 1:
            raise ConfigError(f"segment size must be at least 1, got {self.segment}")
        if self.max_nodes // self.unit * self.unit < self.min_nodes:
            what = f"node unit {self.node_unit}"
            if self.segment > 1:
                what = f"{self.unit} (node unit {self.node_unit}, segment {self.segment})"
            raise ConfigError(f"no multiple of {what} lies in {self.min_nodes}:{self.max_nodes}")

    @property
    def unit(self) -> int:
        """A round's node count is a multiple of this: of the node unit and the segment."""
        return math.lcm(self.node_unit, self.segment)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Waiter:
    agent_id: str
    joined_at: float
    was_active: bool = False  # in the previous round: kept in preference to spares
    block: str = ""  # its node's block (segments only; "" outside the topology)
    order: int = 0  # its node's place in the topology's rank order (segments only)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    kind: DecisionKind
    chosen: tuple[str, ...] = ()
    wake_at: float | None = None  # call decide() again at this time (monotonic seconds)


def usable_count(params: RdzvParams, waiting: int) -> int:
    """How many of ``waiting`` nodes a round can take: at most MAX, a multiple of the unit
    (with segments: at most this many; :func:`decide` also counts whole segments per block)."""
    n = min(waiting, params.max_nodes)
    return n // params.unit * params.unit


def decide(
    *,
    params: RdzvParams,
    waiting: Sequence[Waiter],
    alive: int,
    initial: bool = False,
    opened_at: float,
    now: float,
    returning: int = 0,
) -> Decision:
    """Decide a rendezvous round.

    A round completes at once with MAX nodes, or after the last call (``last_call_s`` after
    the newest join) with at least MIN.  In a re-rendezvous (``initial`` False) ``alive`` counts
    every agent that may still join (waiting ones included); when all of them wait there is
    nobody left to wait for, so a round of at least MIN completes at once: recovery does not pay
    the last call.  ``returning`` counts the previous round's nodes that are alive but not
    waiting yet: while any is, MAX waiting nodes (spares among them) do not complete the round
    before the last call, so a slow re-join does not lose its place (and its memory checkpoint)
    to a spare.
    """
    count = usable_count(params, len(waiting))
    candidates: list[Candidate] = []
    if params.segment > 1:
        candidates = [
            Candidate(agent_id=w.agent_id, block=w.block, order=w.order, was_active=w.was_active)
            for w in waiting
        ]
        count = usable_count(params, segment_capacity(candidates, params.segment))
    if count >= params.min_nodes:
        newest = max(w.joined_at for w in waiting)
        deadline = newest + params.last_call_s
        everyone = not initial and len(waiting) >= alive
        full = len(waiting) >= params.max_nodes and not returning
        if candidates:  # with segments: MAX is reached when whole segments fill it
            full = count >= params.max_nodes // params.unit * params.unit and not returning
        if full or everyone or now >= deadline:
            if candidates:
                chosen = choose_segments(candidates, params.segment, count)
            else:
                chosen = _choose(waiting, count)
            return Decision(kind=DecisionKind.COMPLETE, chosen=chosen)
        return Decision(kind=DecisionKind.WAIT, wake_at=deadline)
    if now - opened_at >= params.timeout_s:
        return Decision(kind=DecisionKind.TIMEOUT)
    return Decision(kind=DecisionKind.WAIT, wake_at=opened_at + params.timeout_s)


def _choose(waiting: Sequence[Waiter], count: int) -> tuple[str, ...]:
    """Previous participants first (keeps spares spare), then in join order."""
    ranked = sorted(waiting, key=lambda w: (not w.was_active, w.joined_at, w.agent_id))
    return tuple(w.agent_id for w in ranked[:count])
