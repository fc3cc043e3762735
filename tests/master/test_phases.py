"""The job's phase table: every allowed transition, and every other one refused."""

from __future__ import annotations

import itertools

import pytest

from dlrover_hpc.master.phases import (
    ENDED,
    FORMING,
    REOPEN,
    TRANSITIONS,
    Phase,
    TransitionError,
    check_transition,
    ended_phase,
)

ALLOWED = {
    (Phase.WAITING, Phase.NETCHECK),
    (Phase.WAITING, Phase.RUNNING),
    (Phase.WAITING, Phase.FAILED),
    (Phase.NETCHECK, Phase.WAITING),
    (Phase.NETCHECK, Phase.RENDEZVOUS),
    (Phase.NETCHECK, Phase.RESTARTING),
    (Phase.NETCHECK, Phase.SHRINKING),
    (Phase.NETCHECK, Phase.REPLACING),
    (Phase.NETCHECK, Phase.RUNNING),
    (Phase.NETCHECK, Phase.FAILED),
    (Phase.RUNNING, Phase.RENDEZVOUS),
    (Phase.RUNNING, Phase.RESTARTING),
    (Phase.RUNNING, Phase.SHRINKING),
    (Phase.RUNNING, Phase.FINISHED),
    (Phase.RUNNING, Phase.FAILED),
    *(
        (forming, after)
        for forming in (Phase.RENDEZVOUS, Phase.RESTARTING, Phase.SHRINKING)
        for after in (Phase.NETCHECK, Phase.RUNNING, Phase.REPLACING, Phase.FAILED)
    ),
    (Phase.REPLACING, Phase.NETCHECK),
    (Phase.REPLACING, Phase.RUNNING),
    (Phase.REPLACING, Phase.FAILED),
}


@pytest.mark.parametrize("old,new", sorted(itertools.product(Phase, Phase)))
def test_every_transition_is_allowed_exactly_as_the_table_says(old: Phase, new: Phase) -> None:
    if old is new or (old, new) in ALLOWED:
        assert check_transition(old, new) is new
    else:
        with pytest.raises(TransitionError, match=f"from {old} to {new}"):
            check_transition(old, new)


def test_table_shape() -> None:
    assert set(TRANSITIONS) == set(Phase)
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == ALLOWED
    # Ended phases are final; every other phase can fail; only a running job can succeed.
    assert all(not TRANSITIONS[p] for p in ENDED)
    assert all(Phase.FAILED in TRANSITIONS[p] for p in set(Phase) - ENDED)
    assert [p for p in Phase if Phase.FINISHED in TRANSITIONS[p]] == [Phase.RUNNING]
    # A running round is only ever given up into a phase where a new round forms.
    assert REOPEN <= FORMING
    assert TRANSITIONS[Phase.RUNNING] - ENDED == REOPEN


def test_ended_phase_by_exit_code() -> None:
    assert ended_phase(0) is Phase.FINISHED
    assert ended_phase(1) is Phase.FAILED
    assert ended_phase(143) is Phase.FAILED
