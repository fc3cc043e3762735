"""The agent's decisions, as pure functions: what an assignment means, when a round is over.

:class:`dlrover_hpc.agent.agent.Agent` does the I/O (the master, the workers, the saver) and asks
these what to do; ``tests/agent/test_decisions.py`` covers each case.
"""

from __future__ import annotations

import dataclasses
from enum import Enum

from dlrover_hpc.protocol import messages as m


class Outcome(Enum):
    """How a round ended for this node."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ROUND_CHANGED = "round_changed"
    STOPPED = "stopped"  # SIGTERM/SIGINT to the agent


class Next(Enum):
    RUN = "run"  # start this node's workers for the assigned round
    PROBE = "probe"  # run a network-check probe, report, wait again
    EXIT = "exit"  # leave with ``exit_code``


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    next: Next
    exit_code: int = 0


def on_assignment(a: m.Assignment) -> Step:
    """What the master's answer to a WaitRound asks of this agent."""
    match a.status:
        case m.NodeStatus.ACTIVE:
            return Step(Next.RUN)
        case m.NodeStatus.NETCHECK:
            return Step(Next.PROBE)
        case m.NodeStatus.FINISHED:
            return Step(Next.EXIT, a.exit_code)
        case m.NodeStatus.EXCLUDED:
            return Step(Next.EXIT, 1)
    raise AssertionError(f"unhandled node status {a.status!r}")


def round_outcome(
    *, stopped: bool, round_changed: bool, exited: bool, failed: bool
) -> Outcome | None:
    """One look at the workers (``exited``: all are done, ``failed``: one failed);
    None: the round goes on.

    A failure is reported even when the round moved on: it may be the cause (a hardware fault)
    that a peer's report raced ahead of.
    """
    if stopped:
        return Outcome.STOPPED
    if failed:
        return Outcome.FAILED
    if round_changed:
        return Outcome.ROUND_CHANGED
    if exited:
        return Outcome.SUCCEEDED
    return None


def round_over(reply: m.HeartbeatReply, *, my_round: int, workers_running: bool) -> bool:
    """The heartbeat shows a newer round or the job's end while this node's workers run
    (the push that says so may have been lost with a connection), or that the master no
    longer counts this node in its round (lost, then back while the next round waits for
    nodes: workers that change rounds in-process would wait for a word otherwise)."""
    left_out = reply.round == my_round and not reply.member
    return workers_running and (reply.round > my_round or reply.finished or left_out)
