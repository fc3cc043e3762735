"""The agent's decisions: what each assignment asks, when a round ends, when to stop."""

from __future__ import annotations

import pytest

from dlrover_hpc.agent.decisions import (
    Next,
    Outcome,
    Step,
    on_assignment,
    round_outcome,
    round_over,
)
from dlrover_hpc.protocol import messages as m


@pytest.mark.parametrize(
    "assignment,expected",
    [
        (m.Assignment(status=m.NodeStatus.ACTIVE, round=3), Step(Next.RUN)),
        (m.Assignment(status=m.NodeStatus.NETCHECK, check_round=1), Step(Next.PROBE)),
        (m.Assignment(status=m.NodeStatus.FINISHED, exit_code=0), Step(Next.EXIT, 0)),
        (m.Assignment(status=m.NodeStatus.FINISHED, exit_code=143), Step(Next.EXIT, 143)),
        (m.Assignment(status=m.NodeStatus.EXCLUDED, reason="drained"), Step(Next.EXIT, 1)),
    ],
)
def test_on_assignment(assignment: m.Assignment, expected: Step) -> None:
    assert on_assignment(assignment) == expected


@pytest.mark.parametrize(
    "stopped,changed,exited,failed,expected",
    [
        (False, False, False, False, None),  # workers run, nothing new
        (False, False, True, False, Outcome.SUCCEEDED),
        (False, False, True, True, Outcome.FAILED),
        (False, True, False, False, Outcome.ROUND_CHANGED),
        # The round moved on and our workers exited cleanly meanwhile: re-join, not "done".
        (False, True, True, False, Outcome.ROUND_CHANGED),
        # ... but a failure is still reported: it may be the cause a peer's report raced.
        (False, True, True, True, Outcome.FAILED),
        # A signal to the agent wins over everything.
        (True, True, True, True, Outcome.STOPPED),
        (True, False, False, False, Outcome.STOPPED),
    ],
)
def test_round_outcome(
    stopped: bool, changed: bool, exited: bool, failed: bool, expected: Outcome | None
) -> None:
    got = round_outcome(stopped=stopped, round_changed=changed, exited=exited, failed=failed)
    assert got is expected


@pytest.mark.parametrize(
    "round,finished,member,running,expected",
    [
        (2, False, True, True, False),  # our round
        (3, False, True, True, True),  # a newer round: the push was lost
        (2, True, True, True, True),  # the job ended
        (3, True, True, False, False),  # no workers to stop
        (2, False, False, True, True),  # lost and back: the master counts us out of round 2
        (1, False, False, True, False),  # a reply from before our round formed
        (2, False, False, False, False),  # a spare: nothing runs
    ],
)
def test_round_over(
    round: int, finished: bool, member: bool, running: bool, expected: bool
) -> None:
    reply = m.HeartbeatReply(round=round, finished=finished, member=member)
    assert round_over(reply, my_round=2, workers_running=running) is expected
