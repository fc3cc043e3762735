"""The job's phases and the transitions between them, as data.

A job starts ``waiting`` for its first rendezvous.  While a round is *forming* (``waiting``,
``rendezvous``, ``restarting``, ``shrinking``, ``replacing``) the rendezvous decision runs on
every change; ``netcheck`` holds a formed round while its nodes probe each other.  ``running``
ends in ``finished`` (every worker succeeded) or ``failed`` (any other end: restarts used up,
rendezvous timed out, requeued, stopped by a signal).  :class:`dlrover_hpc.master.job.Job` moves
between phases only through :func:`check_transition`, and ``tests/master`` walks this table.
"""

from __future__ import annotations

from enum import StrEnum

from dlrover_hpc.errors import DlroverHpcError


class Phase(StrEnum):
    WAITING = "waiting"  # before the first round: agents are joining
    RENDEZVOUS = "rendezvous"  # a new round forms to take in waiting nodes (scale up)
    NETCHECK = "netcheck"  # the chosen nodes run the pairwise network check
    RUNNING = "running"  # workers run
    RESTARTING = "restarting"  # a worker failed: the nodes restart their workers
    SHRINKING = "shrinking"  # a node was lost or excluded: the others form a smaller round
    REPLACING = "replacing"  # fewer than MIN nodes: waiting for replacements (then requeue)
    FINISHED = "finished"  # every worker succeeded
    FAILED = "failed"  # restarts used up, rendezvous timeout, requeued, or stopped


#: A round is open and the rendezvous decision runs.
FORMING = frozenset(
    {Phase.WAITING, Phase.RENDEZVOUS, Phase.RESTARTING, Phase.SHRINKING, Phase.REPLACING}
)
ENDED = frozenset({Phase.FINISHED, Phase.FAILED})

#: Why a running round is given up, and the phase that follows.
REOPEN = frozenset({Phase.RENDEZVOUS, Phase.RESTARTING, Phase.SHRINKING})

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.WAITING: frozenset({Phase.NETCHECK, Phase.RUNNING, Phase.FAILED}),
    Phase.NETCHECK: FORMING | {Phase.RUNNING, Phase.FAILED},  # back to the phase it came from
    Phase.RUNNING: REOPEN | ENDED,
    Phase.RENDEZVOUS: frozenset({Phase.NETCHECK, Phase.RUNNING, Phase.REPLACING, Phase.FAILED}),
    Phase.RESTARTING: frozenset({Phase.NETCHECK, Phase.RUNNING, Phase.REPLACING, Phase.FAILED}),
    Phase.SHRINKING: frozenset({Phase.NETCHECK, Phase.RUNNING, Phase.REPLACING, Phase.FAILED}),
    Phase.REPLACING: frozenset({Phase.NETCHECK, Phase.RUNNING, Phase.FAILED}),
    Phase.FINISHED: frozenset(),
    Phase.FAILED: frozenset(),
}


class TransitionError(DlroverHpcError):
    """A phase change the table does not allow: a bug in the master, never a user error."""


def check_transition(old: Phase, new: Phase) -> Phase:
    """``new`` when ``old -> new`` is in :data:`TRANSITIONS` (or no change); else raise."""
    if new is old or new in TRANSITIONS[old]:
        return new
    raise TransitionError(f"the job cannot go from {old} to {new}")


def ended_phase(exit_code: int) -> Phase:
    return Phase.FINISHED if exit_code == 0 else Phase.FAILED
