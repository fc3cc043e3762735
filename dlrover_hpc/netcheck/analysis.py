"""Pure analysis of the pairwise network check: plan the groups of each round, read the results.

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
  more than `straggler_factor` (2) times the median of all nodes' best times. In a collective the
  partner of a slow node waits for it and looks slow too, so a candidate seen in one group only is
  re-measured next to a fast node before it counts as settled.

Round 1 (`plan_round1`) pairs neighbours in rank order (0-1, 2-3, ...), which topology ordering
makes switch-local. With an odd count the last group is a triple: every node runs exactly one
probe per round (pairing the last node with an already tested node would make that node run two
probes at once and skew both timings).

Resolution bounds (checked by `tests/test_netcheck_analysis.py`): with f faulty nodes and
f <= n/4, round 1 leaves at most 2f+1 unresolved nodes next to at least n-2f-1 healthy ones, so
round 2 gives all of them but at most one a healthy partner and round 3 settles that one. A
single faulty node among n >= 4 is found in 2 rounds.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from dlrover_hpc.errors import DlroverHpcError

logger = logging.getLogger(__name__)

DEFAULT_MAX_ROUNDS = 3
DEFAULT_STRAGGLER_FACTOR = 2.0

Group = tuple[str, ...]


class NetcheckError(DlroverHpcError):
    """A network-check plan or result is malformed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupResult:
    """What one group reported for one round.

    `elapsed_s` maps a member to its check time (matmul plus collectives); members of a failed
    group usually have none. The mapping is copied at construction.
    """

    nodes: Group
    ok: bool
    elapsed_s: Mapping[str, float] = field(default_factory=dict)
    error: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "elapsed_s", dict(self.elapsed_s))
        if len(self.nodes) < 2:
            raise NetcheckError(
                f"group {list(self.nodes)!r} has {len(self.nodes)} node(s); "
                "a network-check group needs at least 2 nodes"
            )
        if len(set(self.nodes)) != len(self.nodes):
            raise NetcheckError(f"group {list(self.nodes)!r} names a node twice")
        for node, seconds in self.elapsed_s.items():
            if node not in self.nodes:
                raise NetcheckError(
                    f"group {list(self.nodes)!r} reports a time for {node!r}, "
                    "which is not a member of the group"
                )
            if not (math.isfinite(seconds) and seconds >= 0.0):
                raise NetcheckError(
                    f"group {list(self.nodes)!r}: elapsed_s[{node!r}] = {seconds!r}; "
                    "expected a finite number of seconds >= 0"
                )


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundResult:
    """All groups of one round; a node appears in at most one group per round."""

    round_index: int
    groups: tuple[GroupResult, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        seen: dict[str, Group] = {}
        for group in self.groups:
            for node in group.nodes:
                if node in seen:
                    raise NetcheckError(
                        f"round {self.round_index}: node {node!r} is in group "
                        f"{list(seen[node])!r} and in group {list(group.nodes)!r}; "
                        "a node runs one probe per round"
                    )
                seen[node] = group.nodes


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckVerdict:
    """The analysis of the rounds so far.

    `faulty` and `stragglers` are final only when `needs_another_round` is False. `unresolved`
    nodes could not be told apart within the rounds allowed; they are not blamed, the caller
    decides (retry the check, or exclude them). `unexplained_failures` are failed groups whose
    members all passed elsewhere (a flaky link between two working nodes): no node is blamed.
    """

    faulty: frozenset[str]
    stragglers: frozenset[str]
    healthy: frozenset[str]
    unresolved: frozenset[str]
    needs_another_round: bool
    rounds_used: int
    timings_s: Mapping[str, float]
    median_s: float | None
    unexplained_failures: tuple[Group, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class _Evidence:
    """What the rounds prove, in the order nodes first appeared (rank order for round 1)."""

    order: tuple[str, ...]
    healthy: frozenset[str]
    faulty: frozenset[str]
    unresolved: frozenset[str]
    best_s: Mapping[str, float]
    passes: Mapping[str, int]  # distinct partner sets a node passed with
    partners: Mapping[str, frozenset[str]]
    median_s: float | None
    candidates: frozenset[str]
    unconfirmed: frozenset[str]
    unexplained: tuple[Group, ...]


def plan_round1(nodes: Sequence[str]) -> list[Group]:
    """Pair neighbours in rank order: (0, 1), (2, 3), ...; an odd count ends with a triple.

    Fewer than 2 nodes cannot be checked; the plan is then empty.
    """
    order = _unique(nodes)
    if len(order) < 2:
        return []
    groups = [tuple(order[i : i + 2]) for i in range(0, len(order) - 1, 2)]
    if len(order) % 2:
        groups[-1] = (*groups[-1], order[-1])
    return groups


def plan_round2(nodes: Sequence[str], failed: set[str] | frozenset[str]) -> list[Group]:
    """Plan round 2 from round 1's outcome when only the failures are known (no timings).

    `failed` holds nodes of failed round-1 groups (one member per failed group is enough). Every
    member of a failed group is paired with a node that passed round 1; see `plan_next_round`.
    """
    order = _unique(nodes)
    unknown = set(failed) - set(order)
    if unknown:
        raise NetcheckError(f"failed nodes {sorted(unknown)!r} are not among the checked nodes")
    round1 = RoundResult(
        round_index=1,
        groups=tuple(
            GroupResult(nodes=group, ok=not set(group) & set(failed))
            for group in plan_round1(order)
        ),
    )
    return plan_next_round([round1])


def plan_next_round(
    rounds: Sequence[RoundResult],
    *,
    straggler_factor: float = DEFAULT_STRAGGLER_FACTOR,
) -> list[Group]:
    """Groups for the next round, or [] when another round would tell nothing new.

    Unresolved nodes get the fastest healthy partners (one each), then straggler candidates get
    fast healthy partners they have not met, then leftover unresolved nodes are paired with
    unresolved nodes they have not met; the remaining healthy nodes pair fastest with slowest
    for extra timings. Known-faulty nodes sit the round out, and so does an odd unresolved node
    left without any new partner.
    """
    return _informative_plan(_gather(rounds, straggler_factor=straggler_factor))


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
    evidence = _gather(rounds, straggler_factor=straggler_factor)
    more = len(rounds) < max_rounds and bool(_informative_plan(evidence))
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


def _unique(nodes: Sequence[str]) -> list[str]:
    if isinstance(nodes, str):
        raise NetcheckError(f"nodes must be a sequence of node names, got the string {nodes!r}")
    seen: set[str] = set()
    for node in nodes:
        if node in seen:
            raise NetcheckError(f"node {node!r} is listed twice; each node is checked once")
        seen.add(node)
    return list(nodes)


def _gather(rounds: Sequence[RoundResult], *, straggler_factor: float) -> _Evidence:
    order: dict[str, None] = {}
    healthy: set[str] = set()
    times: dict[str, float] = {}
    passes: dict[str, set[frozenset[str]]] = {}
    partners: dict[str, set[str]] = {}
    failed_groups: list[Group] = []
    for round_ in rounds:
        for group in round_.groups:
            for node in group.nodes:
                order.setdefault(node, None)
                partners.setdefault(node, set()).update(n for n in group.nodes if n != node)
            if not group.ok:
                failed_groups.append(group.nodes)
                continue
            healthy.update(group.nodes)
            for node in group.nodes:
                passes.setdefault(node, set()).add(frozenset(group.nodes) - {node})
            for node, seconds in group.elapsed_s.items():
                times[node] = min(seconds, times.get(node, math.inf))
    faulty: set[str] = set()
    unexplained: list[Group] = []
    for nodes in failed_groups:
        suspects = [n for n in nodes if n not in healthy]
        if len(suspects) == 1:
            faulty.add(suspects[0])
        elif not suspects:
            unexplained.append(nodes)
    median_s = statistics.median(times.values()) if len(times) >= 2 else None
    candidates = (
        {n for n, t in times.items() if t > straggler_factor * median_s}
        if median_s is not None
        else set()
    )
    return _Evidence(
        order=tuple(order),
        healthy=frozenset(healthy),
        faulty=frozenset(faulty),
        unresolved=frozenset(set(order) - healthy - faulty),
        best_s=times,
        passes={n: len(p) for n, p in passes.items()},
        partners={n: frozenset(p) for n, p in partners.items()},
        median_s=median_s,
        candidates=frozenset(candidates),
        unconfirmed=frozenset(n for n in candidates if len(passes.get(n, ())) < 2),
        unexplained=tuple(unexplained),
    )


def _informative_plan(ev: _Evidence) -> list[Group]:
    if not (ev.unresolved or ev.unconfirmed):
        return []
    groups = _plan(ev)
    interesting = ev.unresolved | ev.unconfirmed
    if not any(interesting.intersection(group) for group in groups):
        return []
    return groups


def _plan(ev: _Evidence) -> list[Group]:
    rank = {node: i for i, node in enumerate(ev.order)}

    def speed(node: str) -> tuple[bool, float, int]:
        return (node not in ev.best_s, ev.best_s.get(node, 0.0), rank[node])

    suspects = [n for n in ev.order if n in ev.unresolved]
    checking = sorted(ev.unconfirmed, key=speed)
    pool = sorted((n for n in ev.healthy if n not in ev.candidates), key=speed)
    slow_settled = sorted(ev.candidates - ev.unconfirmed, key=speed)
    groups: list[Group] = []
    kinds: list[str] = []  # "suspect+healthy", "suspects", "healthy"

    lonely: list[str] = []
    for node in suspects:
        # A slow partner still proves pass/fail; it only costs timing, so use one if needed.
        source = pool or slow_settled or checking
        if source:
            groups.append((node, source.pop(0)))
            kinds.append("suspect+healthy")
        else:
            lonely.append(node)
    for node in checking:
        partner = next((p for p in pool if p not in ev.partners.get(node, ())), None)
        if partner is None and pool:
            partner = pool[0]
        if partner is None:
            slow_settled.append(node)
            continue
        pool.remove(partner)
        groups.append((node, partner))
        kinds.append("healthy")

    spare_suspect = _pair_strangers(lonely, ev.partners, groups, kinds)

    rest = pool + slow_settled
    while len(rest) >= 2:
        fast = rest.pop(0)
        slow = next((p for p in reversed(rest) if p not in ev.partners.get(fast, ())), rest[-1])
        rest.remove(slow)
        groups.append((fast, slow))
        kinds.append("healthy")
    if rest:
        _add_spare_healthy(rest[0], groups, kinds)
    if spare_suspect is not None and "suspects" in kinds:
        i = len(kinds) - 1 - kinds[::-1].index("suspects")
        groups[i] = (*groups[i], spare_suspect)
    return groups


def _pair_strangers(
    nodes: list[str],
    partners: Mapping[str, frozenset[str]],
    groups: list[Group],
    kinds: list[str],
) -> str | None:
    """Pair unresolved nodes that have never been grouped together; return one left over."""
    waiting = list(nodes)
    leftover: list[str] = []
    while waiting:
        node = waiting.pop(0)
        # Prefer the stranger farthest away in rank order: round-1 neighbours are already known.
        mate = next((m for m in reversed(waiting) if m not in partners.get(node, ())), None)
        if mate is None:
            leftover.append(node)
            continue
        waiting.remove(mate)
        groups.append((node, mate))
        kinds.append("suspects")
    if leftover:
        logger.debug("netcheck_plan_idle nodes=%s", ",".join(leftover))
    return leftover[0] if len(leftover) == 1 else None


def _add_spare_healthy(node: str, groups: list[Group], kinds: list[str]) -> None:
    """A healthy node without a partner joins a group that stays informative with it."""
    for wanted in ("healthy", "suspect+healthy"):
        if wanted in kinds:
            i = len(kinds) - 1 - kinds[::-1].index(wanted)
            groups[i] = (*groups[i], node)
            return
