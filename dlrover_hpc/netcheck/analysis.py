"""Pure analysis of the pairwise network check: the verdict after each round, and the check loop.

The check runs in rounds. In every round the nodes are split into small groups (pairs, at most a
triple); every group runs the probe (`netcheck.probe`) together and reports whether it passed and
how long each node took. The analysis is a pure function of the reported rounds:

* A node that passed in any group is **healthy** (success is sticky: a healthy partner cannot make
  a group pass, so a pass proves every member works).
* A failed group proves that *at least one* of its members is broken. When every other member of a
  failed group is known healthy, the remaining member is **faulty**. Nothing else blames a node:
  "failed in every group" alone is *not* used, because a healthy node that happened to sit with a
  faulty node in each round also failed in every group. So a healthy node is never blamed as long
  as a passing group really means its members work.
* A node that is neither is **unresolved**; the next round gives every unresolved node a healthy
  partner of its own (`plan_next_round`). When healthy partners run out, the remaining unresolved
  nodes are paired with each other, choosing partners they have not been grouped with before, so a
  pass clears both and elimination does the rest.
* A **straggler** is a healthy node whose check time (its best time over all passed groups) is
  more than `straggler_factor` (2) times the median of all nodes' best times, and at least
  `MIN_STRAGGLER_EXTRA_S` (25 ms) more: on a check this short, a host busy with other work doubles
  a healthy node's time (see `evidence.py`). In a collective the partner of a slow node waits for
  it and looks slow too, so a candidate seen in one group only is re-measured next to a fast node
  before it counts as settled.

Round 1 (`plan_round1`) pairs neighbours in rank order (0-1, 2-3, ...), which topology ordering
makes switch-local. With an odd count the last group is a triple: every node runs exactly one
probe per round (pairing the last node with an already tested node would make that node run two
probes at once and skew both timings).

Resolution bounds (checked by `tests/netcheck/test_analysis.py`): with f faulty nodes and
f <= n/4, round 1 leaves at most 2f+1 unresolved nodes next to at least n-2f-1 healthy ones, so
round 2 gives all of them but at most one a healthy partner and round 3 settles that one. A
single faulty node among n >= 4 is found in 2 rounds.

The values live in `model.py`, what the rounds prove in `evidence.py`, the groups of each round
in `planning.py`; this module is their public face and re-exports what callers use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from dlrover_hpc.netcheck.evidence import DEFAULT_STRAGGLER_FACTOR, gather_evidence
from dlrover_hpc.netcheck.model import CheckVerdict, Group, GroupResult, NetcheckError, RoundResult
from dlrover_hpc.netcheck.planning import (
    informative_plan,
    plan_next_round,
    plan_round1,
    plan_round2,
)

__all__ = [
    "DEFAULT_MAX_ROUNDS",
    "DEFAULT_STRAGGLER_FACTOR",
    "CheckVerdict",
    "Group",
    "GroupResult",
    "NetcheckError",
    "RoundResult",
    "analyze",
    "plan_next_round",
    "plan_round1",
    "plan_round2",
    "run_check",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_ROUNDS = 3


def analyze(
    rounds: Sequence[RoundResult],
    *,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    straggler_factor: float = DEFAULT_STRAGGLER_FACTOR,
) -> CheckVerdict:
    """Read the rounds so far: who is faulty, who straggles, and whether to run another round."""
    if max_rounds < 1:
        raise NetcheckError(f"max_rounds={max_rounds}; expected at least 1")
    if not straggler_factor > 1.0:
        raise NetcheckError(f"straggler_factor={straggler_factor}; expected a number above 1")
    evidence = gather_evidence(rounds, straggler_factor=straggler_factor)
    more = len(rounds) < max_rounds and bool(informative_plan(evidence))
    return CheckVerdict(
        faulty=evidence.faulty,
        stragglers=evidence.candidates,
        healthy=evidence.healthy,
        unresolved=evidence.unresolved,
        needs_another_round=more,
        rounds_used=len(rounds),
        timings_s=dict(evidence.best_s),
        median_s=evidence.median_s,
        unexplained_failures=evidence.unexplained,
    )


def run_check(
    nodes: Sequence[str],
    *,
    run_round: Callable[[int, list[Group]], RoundResult],
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    straggler_factor: float = DEFAULT_STRAGGLER_FACTOR,
) -> tuple[CheckVerdict, list[RoundResult]]:
    """Drive a whole check: plan, let `run_round(round_index, groups)` probe, analyse, repeat.

    `run_round` does the I/O (it is the master's executor, or a simulation in tests); this loop
    stays pure otherwise. Returns the final verdict and every round's results.
    """
    rounds: list[RoundResult] = []
    groups = plan_round1(nodes)
    verdict = analyze(rounds, max_rounds=max_rounds, straggler_factor=straggler_factor)
    while groups:
        result = run_round(len(rounds) + 1, groups)
        expected = {frozenset(g) for g in groups}
        if {frozenset(g.nodes) for g in result.groups} != expected:
            raise NetcheckError(
                f"round {len(rounds) + 1}: run_round reported groups "
                f"{[list(g.nodes) for g in result.groups]!r}, planned {[list(g) for g in groups]!r}"
            )
        rounds.append(result)
        verdict = analyze(rounds, max_rounds=max_rounds, straggler_factor=straggler_factor)
        logger.info(
            "netcheck_round round=%d groups=%d faulty=%d unresolved=%d stragglers=%d more=%s",
            len(rounds),
            len(groups),
            len(verdict.faulty),
            len(verdict.unresolved),
            len(verdict.stragglers),
            verdict.needs_another_round,
        )
        if not verdict.needs_another_round:
            break
        groups = plan_next_round(rounds, straggler_factor=straggler_factor)
    return verdict, rounds
