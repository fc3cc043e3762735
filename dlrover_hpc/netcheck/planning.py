"""Who probes with whom: the groups of round 1 and of every following round.

Round 1 pairs neighbours in rank order; later rounds give each unresolved node a healthy partner,
re-measure straggler candidates next to fast nodes, and pair the rest with nodes they have not
met. See `analysis.py` for the reasoning and the resolution bounds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from dlrover_hpc.netcheck.evidence import DEFAULT_STRAGGLER_FACTOR, Evidence, gather_evidence
from dlrover_hpc.netcheck.model import Group, GroupResult, NetcheckError, RoundResult

logger = logging.getLogger(__name__)


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
    return informative_plan(gather_evidence(rounds, straggler_factor=straggler_factor))


def _unique(nodes: Sequence[str]) -> list[str]:
    if isinstance(nodes, str):
        raise NetcheckError(f"nodes must be a sequence of node names, got the string {nodes!r}")
    seen: set[str] = set()
    for node in nodes:
        if node in seen:
            raise NetcheckError(f"node {node!r} is listed twice; each node is checked once")
        seen.add(node)
    return list(nodes)


def informative_plan(ev: Evidence) -> list[Group]:
    """The next round's groups, or [] when none would tell anything new about a node."""
    if not (ev.unresolved or ev.unconfirmed):
        return []
    groups = _plan(ev)
    interesting = ev.unresolved | ev.unconfirmed
    if not any(interesting.intersection(group) for group in groups):
        return []
    return groups


def _plan(ev: Evidence) -> list[Group]:
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
