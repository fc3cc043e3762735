"""What the rounds of a network check prove about each node: the evidence plans and verdicts use.

A node that passed in any group is healthy; the one member of a failed group whose partners all
passed elsewhere is faulty; a healthy node whose best time exceeds `straggler_factor` times the
median, and :data:`MIN_STRAGGLER_EXTRA_S` longer, is a straggler candidate, unconfirmed until it
passed with two different partner sets. See `analysis.py` for why.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dlrover_hpc.netcheck.model import Group, RoundResult

DEFAULT_STRAGGLER_FACTOR = 2.0
#: A straggler's best time exceeds the median by this much at least.  On a ~13 ms check a
#: host busy with other work doubles a node's best time in both rounds (CI: 30 ms against a
#: 13 ms median, on 2 cores shared by four test jobs), and a straggler named here loses its
#: place in the job.  A slow node or link that costs less than this per check (a 4 MiB
#: all-reduce and a matmul) is left to the runtime detectors, which compare every step
#: (``master/step_slowness.py``, ``master/link_slowness.py``).  The slow links the tests cut
#: to a few Mbit/s take 0.3-0.7 s here against a ~20 ms median.
MIN_STRAGGLER_EXTRA_S = 0.025


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
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


def gather_evidence(rounds: Sequence[RoundResult], *, straggler_factor: float) -> Evidence:
    """Read every group of every round into what it proves about each node."""
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
        {
            n
            for n, t in times.items()
            if t > straggler_factor * median_s and t - median_s >= MIN_STRAGGLER_EXTRA_S
        }
        if median_s is not None
        else set()
    )
    return Evidence(
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
