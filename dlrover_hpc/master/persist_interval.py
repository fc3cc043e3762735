"""How often to persist a step held in memory: Young/Daly's interval (``--persist-every auto``).

Pure functions; :mod:`dlrover_hpc.master.auto_persist` feeds them what the job measured.

The interval is Daly's first-order form (J. T. Daly, "A higher order estimate of the optimum
checkpoint interval for restart dumps", FGCS 22, 2006), ``sqrt(2 C M) - C``, with ``C`` the time
one persist takes (the slowest node's, measured) and ``M`` the job's mean time between failures.
It grows with ``C`` up to ``C = M / 2``, where it is ``M / 2``; past that the first-order form
falls (to 0 at ``C = 2 M``), so the interval stays ``M / 2`` there: a slower storage never
makes the job persist more often.  It is never under :data:`MIN_INTERVAL_S`.

The job's MTBF: with failures seen (ones that cost a restart), the node-seconds observed per
failure divided by the job's node count (the job fails when any node does); with none, the
site's per-node MTBF (``--node-mtbf``) divided by the node count.
"""

from __future__ import annotations

import dataclasses
import enum
import math

#: The shortest interval chosen: persisting more often than this is storage's whole time.
MIN_INTERVAL_S = 1.0


class MtbfSource(enum.StrEnum):
    OBSERVED = "observed"  # the job's own failures
    SITE = "site"  # --node-mtbf, no failure seen yet


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Mtbf:
    seconds: float
    source: MtbfSource


def daly_interval(persist_s: float, mtbf_s: float) -> float:
    """Seconds between persists for a persist time ``persist_s`` and an MTBF ``mtbf_s``:
    ``sqrt(2 C M) - C`` for ``C <= M / 2``, ``M / 2`` beyond, at least :data:`MIN_INTERVAL_S`.
    Non-decreasing in both arguments."""
    if not (mtbf_s > 0 and math.isfinite(mtbf_s)):
        raise ValueError(f"mtbf_s={mtbf_s}: must be a positive, finite number of seconds")
    c = max(0.0, float(persist_s))
    if not math.isfinite(c):
        raise ValueError(f"persist_s={persist_s}: must be a finite number of seconds")
    interval = mtbf_s / 2 if c >= mtbf_s / 2 else math.sqrt(2 * c * mtbf_s) - c
    return max(MIN_INTERVAL_S, interval)


def job_mtbf(*, failures: int, node_seconds: float, nodes: int, site_node_mtbf_s: float) -> Mtbf:
    """The job's MTBF with ``nodes`` nodes: observed (``node_seconds`` of training per
    failure, per node of the job) once ``failures`` > 0, else the site's per-node MTBF over
    the node count."""
    nodes = max(1, nodes)
    if failures > 0 and node_seconds > 0:
        return Mtbf(seconds=node_seconds / failures / nodes, source=MtbfSource.OBSERVED)
    return Mtbf(seconds=site_node_mtbf_s / nodes, source=MtbfSource.SITE)


def changed(old: float | None, new: float, *, by: float = 0.1) -> bool:
    """Whether an interval moved enough (over ``by`` of the old one) to be said again."""
    return old is None or abs(new - old) > by * old
