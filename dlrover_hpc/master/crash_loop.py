"""The crash-loop guard (issue 48): rounds that keep failing without progress stop the job.

A deterministic fault (a script that segfaults at step 5, a fault classified as hardware that
moves with the job, a node lost at the same point) may cost no restart (a membership change
never spends ``--max-restarts``) and cycle nodes and rounds for as long as there are nodes.  So
every round's end is judged here, whatever ended it:

- a round *failed* when a worker failed (software, hardware, peer), a node of it was lost, or
  a hang restarted it; its *cause* is its first failure that is not a peer's symptom (else its
  first);
- it *progressed* when a checkpoint step newer than any before was committed, or held in
  memory by every rank, or a rank reached a training step beyond the job's best so far;
- ``--crash-loop-rounds`` (K) failed rounds in a row without progress stop the job with
  :data:`EXIT_CODE`, naming the repeated failure; a round that ended for no failure (a
  scale-up, a straggler swap) without progress neither counts nor breaks the run of them;
- a node that was the cause in two of the last K rounds (the window) is excluded (never
  admitted again in this job), when the others are still at least MIN nodes.  A worker
  killed from outside (SIGKILL without OOM evidence: an operator, a script, Slurm) is no
  fault of its node: such a round fails, but it is not charged to the node (soak seed 1: a
  killed worker and then a link cut on the same node, 400 steps apart, excluded it for
  good, and the job later waited 60 s below MIN).

:func:`judge` is pure (a :class:`Guard` and a :class:`RoundEnd` in, the next guard and
:mod:`~dlrover_hpc.master.decisions` actions out); :class:`RoundTally` gathers a running
round's facts from the agents' reports; :class:`dlrover_hpc.master.job.Job` runs both.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Collection, Sequence

from dlrover_hpc.master import decisions as d
from dlrover_hpc.protocol import messages as m

log = logging.getLogger(__name__)

#: The job's exit code when the guard stopped it: not 0/1/2, not a signal's 128+N; the job
#: template never requeues or continues a job that ended with it.
EXIT_CODE = 3
#: The causes that are not the agents' classifications of a worker failure.
NODE_LOST = "node_lost"
HANG = "hang"
#: The diagnosis rules (``dlrover_hpc.diagnosis.classify``) of a worker ended from outside:
#: its round failed, but not by its node's fault.
EXTERNAL_RULES = frozenset({"killed"})
#: An error line is cut to this many characters.
ERROR_CHARS = 300


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Failure:
    """A round's cause: where and how it failed first."""

    round: int
    node: str
    rank: int  # the failed worker's global rank; a lost node: its first rank (-1: unknown)
    classification: str  # software | hardware | peer | node_lost | hang
    error: str  # the first line of the error, as the agent's diagnosis has it
    external: bool = False  # ended from outside (:data:`EXTERNAL_RULES`): not its node's fault

    @property
    def signature(self) -> tuple[int, str]:
        return self.rank, self.classification

    def describe(self) -> str:
        return f"rank {self.rank} on {self.node} ({self.classification}): {self.error}"

    def fields(self) -> dict[str, object]:
        return {
            "round": self.round,
            "node": self.node,
            "rank": self.rank,
            "classification": self.classification,
            "error": self.error,
        }


def error_line(text: str) -> str:
    """The first non-empty line of ``text``, at most :data:`ERROR_CHARS` long."""
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line if len(line) <= ERROR_CHARS else line[: ERROR_CHARS - 3] + "..."


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoundEnd:
    """What a round reached by its end."""

    round: int
    failure: Failure | None  # its cause; None: it ended for no failure
    step: int  # the furthest training step any rank reported (-1: none)
    saved: int  # the newest step every rank held in memory (-1: none, or not every rank told)
    committed: int  # the job's newest committed checkpoint step at its end (-1: none)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Guard:
    """What the guard remembers between rounds."""

    rounds: int  # K: failed rounds in a row without progress that stop the job; 0: off
    #: the furthest training step of any round so far; a fresh job's ranks report step 0 as
    #: they start, before training one, so reaching step 0 is no progress
    best_step: int = 0
    best_checkpoint: int = -1  # the newest step committed, or in memory on every rank
    streak: tuple[Failure, ...] = ()  # the failed rounds in a row without progress, oldest first
    window: tuple[Failure | None, ...] = ()  # the causes of the last K rounds (None: no failure)
    excluded: frozenset[str] = frozenset()  # nodes this guard excluded
    #: a round has reported a step, a save or a commit: the job's progress can be seen.  Until
    #: then a round that reported nothing is not counted: with the worker hooks off
    #: (``--no-worker-hooks``, ``--transparent``) and no progress calls or flash checkpoints,
    #: the master cannot tell a crash loop from rounds that trained for hours
    observed: bool = False

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise ValueError(f"crash-loop rounds must be 0 (off) or more, got {self.rounds}")


def progress(guard: Guard, end: RoundEnd) -> str:
    """Why ``end``'s round counts as progress, or "" when it does not."""
    if end.committed > guard.best_checkpoint:
        return f"step {end.committed} committed"
    if end.saved > guard.best_checkpoint:
        return f"every rank held step {end.saved} in memory"
    if end.step > guard.best_step:
        return f"step {end.step} reached (the best before: {guard.best_step})"
    return ""


def judge(
    guard: Guard,
    end: RoundEnd,
    *,
    usable: Collection[str],
    min_nodes: int,
    excluded: Collection[str] = (),
) -> tuple[Guard, list[d.Action]]:
    """Judge a round that ended (``end``): the guard after it, and what to do.

    ``usable``: the nodes that still count towards the job's capacity (alive, not excluded);
    ``min_nodes``: the job's MIN; ``excluded``: nodes already out of the job.  Returns a
    :class:`~dlrover_hpc.master.decisions.CrashLoop` and a
    :class:`~dlrover_hpc.master.decisions.Finish` when the round is the K-th failed one in a
    row without progress; an :class:`~dlrover_hpc.master.decisions.Exclude` of its cause's
    node when that node caused two of the window's rounds and the others are enough.
    """
    if guard.rounds == 0:
        return guard, []
    why = progress(guard, end)
    guard = dataclasses.replace(
        guard,
        best_step=max(guard.best_step, end.step),
        best_checkpoint=max(guard.best_checkpoint, end.committed, end.saved),
        window=(*guard.window, end.failure)[-guard.rounds :],
        observed=guard.observed or max(end.step, end.saved, end.committed) >= 0,
    )
    failure = end.failure
    if why:  # progress breaks the run; a round that did not fail is neutral
        guard = dataclasses.replace(guard, streak=())
    elif failure is not None and guard.observed:
        guard = dataclasses.replace(guard, streak=(*guard.streak, failure))
        if len(guard.streak) >= guard.rounds:
            return guard, stop(guard.streak)
    if failure is None or failure.classification == d.PEER:
        return guard, []  # a node whose worker only lost a peer did not fail on its own
    node = failure.node
    if failure.external:
        return guard, []  # a kill from outside says nothing about its node
    caused = [
        f.round
        for f in guard.window
        if f is not None and f.node == node and f.classification != d.PEER and not f.external
    ]
    others = {n for n in usable if n != node}
    out = node in guard.excluded or node in excluded
    if len(caused) >= 2 and not out and len(others) >= min_nodes:
        reason = (
            f"crash loop: it failed first in rounds {caused[-2]} and {caused[-1]} of the last "
            f"{guard.rounds} ({failure.describe()})"
        )
        return dataclasses.replace(guard, excluded=guard.excluded | {node}), [
            d.Exclude(node, reason)
        ]
    return guard, []


def repeated(streak: Sequence[Failure]) -> Failure:
    """The failure to name: the (rank, classification) most of the rounds share, its newest
    round's (ties: the newest)."""
    counts = collections.Counter(f.signature for f in streak)
    top = max(counts.values())
    return next(f for f in reversed(streak) if counts[f.signature] == top)


def stop(streak: Sequence[Failure]) -> list[d.Action]:
    """Stop the job: the ``crash_loop`` event, then the job's end with :data:`EXIT_CODE`."""
    named = repeated(streak)
    same = sum(1 for f in streak if f.signature == named.signature)
    rounds = f"rounds {streak[0].round}-{streak[-1].round}" if len(streak) > 1 else "round"
    each = "each time" if same == len(streak) else f"{same} of {len(streak)} times"
    reason = (
        f"crash loop: {len(streak)} rounds in a row ({rounds}) failed without progress; "
        f"{each} first {named.describe()}"
    )
    return [
        d.CrashLoop(
            rounds=len(streak), failure=named.fields(), failures=[f.fields() for f in streak]
        ),
        d.Finish(EXIT_CODE, reason),
    ]


class RoundTally:
    """The running round's facts as the agents report them: each rank's furthest step and
    newest step in memory, and its failures in the order they came."""

    def __init__(self) -> None:
        self.round = 0
        self._steps: dict[int, int] = {}
        self._saved: dict[int, int] = {}
        self._failures: list[Failure] = []

    def begin(self, round: int) -> None:
        self.round = round
        self._steps, self._saved, self._failures = {}, {}, []

    def progress(self, round: int, ranks: Sequence[m.RankProgress]) -> None:
        if round != self.round:
            return
        steps, saved = self._steps, self._saved
        for p in ranks:
            if p.at > 0 and p.step > steps.get(p.rank, -1):  # at 0: no step reported yet
                steps[p.rank] = p.step
            if p.saved_step > saved.get(p.rank, -1):
                saved[p.rank] = p.saved_step

    def failed(self, failure: Failure) -> None:
        if failure.round == self.round:
            self._failures.append(failure)

    def cause(self) -> Failure | None:
        """The first failure that is not a peer's symptom, else the first."""
        own = [f for f in self._failures if f.classification != d.PEER]
        first = own or self._failures
        return first[0] if first else None

    def end(self, *, world_size: int, committed: int) -> RoundEnd:
        every = len(self._saved) >= world_size > 0
        return RoundEnd(
            round=self.round,
            failure=self.cause(),
            step=max(self._steps.values(), default=-1),
            saved=min(self._saved.values()) if every else -1,
            committed=committed,
        )


class LoopWatch:
    """The guard as the job runs it: the running round's tally, and the judgement of each
    round once, when the next one forms (every report of the ended round is in by then: the
    agents report before they re-join), or when the job would fail now."""

    def __init__(self, rounds: int) -> None:
        self.guard = Guard(rounds=rounds)
        self.tally = RoundTally()
        self._judged = 0  # the newest round judged

    def round_ended(
        self,
        *,
        world_size: int,
        committed: int,
        usable: Collection[str],
        min_nodes: int,
        excluded: Collection[str] = (),
    ) -> list[d.Action]:
        """The tallied round is over (the next one forms): judge it, once."""
        if self.tally.round in (0, self._judged):
            return []
        self._judged = self.tally.round
        end = self.tally.end(world_size=world_size, committed=committed)
        why = progress(self.guard, end)
        self.guard, actions = judge(
            self.guard, end, usable=usable, min_nodes=min_nodes, excluded=excluded
        )
        if end.failure is not None:
            log.info(
                "round judged round=%d failed_first=%s progress=%s failed_in_a_row=%d/%d",
                end.round,
                end.failure.describe(),
                why or "none",
                len(self.guard.streak),
                self.guard.rounds,
            )
        return actions

    def failing_now(
        self,
        *,
        world_size: int,
        committed: int,
        usable: Collection[str],
        min_nodes: int,
        excluded: Collection[str] = (),
    ) -> list[d.Action]:
        """The running round fails, and the job with it (no restart left): its stop as a
        crash loop if the round completes one, else nothing (the guard is left as it was)."""
        if self.tally.round in (0, self._judged):
            return []
        end = self.tally.end(world_size=world_size, committed=committed)
        _, actions = judge(self.guard, end, usable=usable, min_nodes=min_nodes)
        return actions if any(isinstance(a, d.Finish) for a in actions) else []
