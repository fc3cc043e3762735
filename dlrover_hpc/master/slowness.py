"""Runtime stragglers and slow links (fail-slow, issue 25): pure comparisons of the ranks'
compute and wait per step, and of the nodes' heartbeat round trips;
:class:`dlrover_hpc.master.hangs.HangWatch` gathers the samples and acts on the verdicts."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

#: Fail-slow: a rank is a straggler once it stood out in the checks for this long, each
#: check comparing the medians of the steps reported in the last :data:`SAMPLE_WINDOW_S` ...
STRAGGLER_WINDOW_S = 20.0
#: ... when it is barely past the threshold.  Stronger evidence needs less time: a rank (or a
#: link) whose median ratio over the episode's checks is k times the threshold is reported
#: after ``STRAGGLER_WINDOW_S / k``, at least this (a node at a quarter speed, ~3.5x its peers,
#: was found 20 s after its first slow check; every one of those seconds is a quarter step
#: for every rank of the job).  See :func:`evidence_window`.
MIN_WINDOW_S = 8.0
SAMPLE_WINDOW_S = 15.0
STRAGGLER_CHECK_S = 2.0  # compare ranks at most this seldom (linear in the ranks; hangs.py)
MIN_SAMPLES = 3
MIN_EXTRA_S = 0.02  # a straggler's compute exceeds its peers' by this much at least
#: A slow link: a node whose heartbeats take this many times its peers' median round trip,
#: and at least :data:`MIN_LINK_EXTRA_S` more (every packet of the node queues behind it).
LINK_FACTOR, MIN_LINK_EXTRA_S = 3.0, 0.015


@dataclasses.dataclass(frozen=True, slots=True)
class Slow:
    """A rank whose compute stands out: its median compute per step over its peers'."""

    ratio: float
    compute_s: float  # its median compute per step
    peers_compute_s: float  # the median of its peers' medians
    peers_wait_s: float  # the median of its peers' median waits: the time they wait for it


#: Up to this many ranks (nodes) each is compared with the median of the *others*; beyond it,
#: with the median of all (the same but for one value, and linear, not quadratic, at scale).
EXACT_PEERS = 32


def _peer_medians(values: dict[Any, float]) -> dict[Any, float]:
    """Each key's peers' median value (see :data:`EXACT_PEERS`)."""
    if len(values) > EXACT_PEERS:
        everyone = statistics.median(values.values())
        return dict.fromkeys(values, everyone)
    return {
        k: statistics.median([v for j, v in values.items() if j != k])
        for k in values
        if len(values) > 1
    }


def stragglers(timings: dict[int, tuple[float, float]], factor: float) -> dict[int, Slow]:
    """Ranks that hold the others back (fail-slow): ``timings`` is each rank's median compute
    and wait per step (data, forward, backward, optimizer; and the wait for its peers).  A
    straggler's compute is ``factor`` times its peers' median, at least :data:`MIN_EXTRA_S`
    more, and its peers wait for it: their median wait covers at least half the difference.
    Without that wait the ranks do not train in lockstep, and nobody is held back."""
    timed = {r: t for r, t in timings.items() if t[0] > 0}
    peers_compute = _peer_medians({r: c for r, (c, _) in timed.items()})
    peers_wait = _peer_medians({r: w for r, (_, w) in timed.items()})
    out = {}
    for rank, peers in peers_compute.items():
        compute, waited = timed[rank][0], peers_wait[rank]
        extra = compute - peers
        if (
            peers > 0
            and compute >= factor * peers
            and extra >= MIN_EXTRA_S
            and waited >= 0.5 * extra
        ):
            out[rank] = Slow(round(compute / peers, 2), compute, peers, waited)
    return out


def evidence_window(ratios: Sequence[float], threshold: float) -> float:
    """How long an episode must last before it is reported: :data:`STRAGGLER_WINDOW_S` over
    how far the median of its checks' ratios is past ``threshold`` (a ratio is the rank's
    compute, or the node's round trip, over its peers'), at least :data:`MIN_WINDOW_S`.  The
    median, not the newest or the largest: one noisy check must not shorten it."""
    if not ratios or threshold <= 0:
        return STRAGGLER_WINDOW_S
    strength = statistics.median(ratios) / threshold
    return max(MIN_WINDOW_S, STRAGGLER_WINDOW_S / max(1.0, strength))


def slow_links(rtts: dict[str, float], *, factor: float = LINK_FACTOR) -> dict[str, Slow]:
    """Nodes whose median heartbeat round trip is ``factor`` times their peers' median and
    :data:`MIN_LINK_EXTRA_S` longer (node -> the evidence; ``compute_s`` holds its round trip,
    ``peers_compute_s`` the peers')."""
    out = {}
    for node, peers in _peer_medians(rtts).items():
        rtt = rtts[node]
        if rtt >= factor * peers and rtt - peers >= MIN_LINK_EXTRA_S:
            out[node] = Slow(round(rtt / peers, 2) if peers > 0 else 0.0, rtt, peers, 0.0)
    return out
