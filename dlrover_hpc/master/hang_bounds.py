"""How long a rank may go without progress before the master calls the job hung (issues 13,
25 and 45): pure rules over the agents' reports; :class:`dlrover_hpc.master.hangs.HangWatch`
applies them.

Each rank is held to a *bound* (:func:`rank_bound`):

- ``--hang-timeout SECONDS``: that, for everything (the behaviour before ``auto``);
- ``auto`` (the default): a rank whose process has been stopped by a signal for
  :data:`STOPPED_BOUND_S` is a hang, whatever the others do; in a section, the section's own
  bound (:data:`SECTION_BOUNDS_S`, or the one the script gave); before the rank has a
  step-time p99 (the first steps after a start: compilation, warm-up, restore), the warm-up
  bound; else ``2 x p99 + 10 s`` of the job's slowest rank, at least :data:`FLOOR_S`; never
  more than :data:`HANG_CEILING_S`.  A rank that computes (its CPU time grows) is held to the
  ceiling: a busy rank is not a hung one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dlrover_hpc.config import HANG_AUTO, HANG_CEILING_S
from dlrover_hpc.protocol import messages as m

#: ``auto``: the learned bound is ``P99_FACTOR x p99 + P99_MARGIN_S``, at least ``FLOOR_S``.
FLOOR_S, P99_FACTOR, P99_MARGIN_S = 30.0, 2.0, 10.0
#: A learned bound is a promise on when ``hang_detected`` is out: the check fires this much
#: earlier, for the heartbeat that reports the stall, the check's tick and reading the stacks.
DETECT_SLACK_S = 3.0
#: ``auto``: a rank that has no step-time p99 yet (the first steps of its process).  Once a
#: round of the job got through its warm-up, later rounds get 3 x the longest warm-up seen
#: + 30 s, at least :data:`WARMUP_MIN_S` (a restart after a hang must not wait 10 minutes).
WARMUP_BOUND_S, WARMUP_MIN_S = 600.0, 120.0
#: ``auto``: a rank whose process has been stopped by a signal (SIGSTOP, SIGTSTP) for this long,
#: throughout, is a hang at once, whatever the other ranks do: it cannot progress until someone
#: continues it, and its peers will wait for it in their next collective.  (A job that Slurm
#: suspends stops its agents too, so they report no such thing.)  Throughout means its main
#: thread did not run between the samples: a throttle that stops and continues it in turn
#: (a slow node) starts the count again at each turn, so 2 s leaves no room for doubt and
#: costs the job 3 s less per such hang than 5 s did.  Not 1 s: the soak's slow node (a worker
#: run 0.1 s of every 0.4 on 2 busy cores) was then called hung, its turns unseen (seed 1).
STOPPED_BOUND_S = 2.0
#: ``auto``: each section's own bound, unless the script gave one; other names get ``eval``'s.
#: A rank in a section also progresses while it (or a data-loader worker) uses CPU.
SECTION_BOUNDS_S = {"checkpoint": 600.0, "eval": 600.0, "data": 300.0, "warmup": WARMUP_BOUND_S}
#: The job is ending: a rank's process has exited (``exit``, from its agent) or a node's
#: workers all succeeded.  The ranks left are in their teardown (destroying process groups,
#: joining threads), where no step comes; a rank that exits before a peer leaves its last
#: collective must not make that peer a hang.  Every rank gets at least this bound.
SECTION_BOUNDS_S["exit"] = ENDING_BOUND_S = 300.0
#: Every rank reached the step of the ranks that exited: the job is ending.  A rank still
#: there this long after its peers exited, blocked (no CPU, no section, no step), hangs at
#: exit (a deadlock in a library's teardown): it is stopped and counted as succeeded, never
#: retrained.  One that computes or is in a section (a final save) gets the ceiling.
EXIT_HANG_S = 15.0


@dataclasses.dataclass(frozen=True, slots=True)
class Bound:
    seconds: float
    #: "step statistics", "section eval", "warm-up", "stopped process", "--hang-timeout", "ceiling"
    source: str


def job_p99(progress: Sequence[m.RankProgress]) -> float:
    """The job's step-time p99: its slowest rank's (0 while no rank has one)."""
    return max((p.p99_s for p in progress), default=0.0)


def warmup_bound(longest_s: float) -> float:
    """The warm-up bound once a warm-up of ``longest_s`` was seen (0: none yet)."""
    if longest_s <= 0:
        return WARMUP_BOUND_S
    return min(WARMUP_BOUND_S, max(WARMUP_MIN_S, 3 * longest_s + 30.0))


def rank_bound(
    p: m.RankProgress, *, timeout_s: float, p99_s: float, warmup_s: float = WARMUP_BOUND_S
) -> Bound:
    """How long ``p``'s rank may go without progress (see the module's docstring)."""
    if timeout_s != HANG_AUTO:
        return Bound(timeout_s, "--hang-timeout")
    if p.section and p.section_bound_s:  # the script's own bound: not capped
        return Bound(p.section_bound_s, f"section {p.section}")
    if p.section:
        bound = SECTION_BOUNDS_S.get(p.section, SECTION_BOUNDS_S["eval"])
        source = f"section {p.section}"
    elif p.p99_s <= 0 or p99_s <= 0:
        bound, source = warmup_s, "warm-up"
    else:
        bound, source = max(FLOOR_S, P99_FACTOR * p99_s + P99_MARGIN_S), "step statistics"
    return Bound(bound, source) if bound <= HANG_CEILING_S else Bound(HANG_CEILING_S, "ceiling")


def hung_ranks(
    seen: Sequence[tuple[m.RankProgress, float]],
    *,
    now: float,
    timeout_s: float,
    warmup_s: float = WARMUP_BOUND_S,
    ending: bool = False,
    working_counts: bool = True,
) -> Bound | None:
    """Every rank went without progress for its bound (each report aged by the time since it
    arrived): the longest of those bounds, the one that decided; or, with ``auto``, one rank
    stopped by a signal for :data:`STOPPED_BOUND_S`.  None while neither is so.  ``ending``
    (a node finished) or a rank in the ``exit`` section: every bound is at least
    :data:`ENDING_BOUND_S` (with ``auto``).  With ``auto``, a rank that computes
    (``working``: its CPU time grows) is held to the ceiling: a busy rank is not a hung one
    (``working_counts=False``: as if it were blocked, to tell that it alone holds a verdict
    back)."""
    ending = ending or any(p.section == "exit" for p, _ in seen)
    if not seen or not timeout_s:
        return None
    if timeout_s == HANG_AUTO and any(
        p.stopped_s > 0 and p.stopped_s + (now - at) >= STOPPED_BOUND_S for p, at in seen
    ):
        return Bound(STOPPED_BOUND_S, "stopped process")
    p99 = job_p99([p for p, _ in seen])
    longest: Bound | None = None
    for p, at in seen:
        bound = rank_bound(p, timeout_s=timeout_s, p99_s=p99, warmup_s=warmup_s)
        if ending and timeout_s == HANG_AUTO and bound.seconds < ENDING_BOUND_S:
            bound = Bound(ENDING_BOUND_S, "job ending")
        if working_counts and timeout_s == HANG_AUTO and p.working:
            bound = Bound(HANG_CEILING_S, "ceiling (computing)")
        # In a section, CPU use is progress; with auto, a section the script gave no bound
        # that is open past the ceiling without a step is not (a rank that spins in a
        # collective it will never leave).  ``section_s`` counts from the newer of the
        # section's start and the rank's newest step.
        forever = (
            timeout_s == HANG_AUTO
            and bool(p.section)
            and not p.section_bound_s
            and p.section_s + (now - at) >= HANG_CEILING_S
        )
        slack = DETECT_SLACK_S if bound.source == "step statistics" else 0.0
        if p.stalled_s + (now - at) < bound.seconds - slack and not forever:
            return None
        if longest is None or bound.seconds > longest.seconds:
            longest = bound
    return longest


def clearly_progressing(
    p: m.RankProgress, age_s: float, *, timeout_s: float, warmup_s: float = WARMUP_BOUND_S
) -> bool:
    """``p``, reported ``age_s`` ago, is within the shortest bound :func:`hung_ranks` could
    hold it to (its own p99 in place of the job's, which is at least as large and only makes
    the bound longer), and it is not stopped: while one rank is, no hang can be found."""
    if p.stopped_s > 0:
        return False
    lower = rank_bound(p, timeout_s=timeout_s, p99_s=p.p99_s, warmup_s=warmup_s)
    forever = (
        timeout_s == HANG_AUTO
        and bool(p.section)
        and not p.section_bound_s
        and p.section_s + age_s >= HANG_CEILING_S
    )
    slack = DETECT_SLACK_S if lower.source == "step statistics" else 0.0
    return not forever and p.stalled_s + age_s < lower.seconds - slack
