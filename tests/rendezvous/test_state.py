"""The pure rendezvous decision."""

from __future__ import annotations

import pytest

from dlrover_hpc.errors import ConfigError
from dlrover_hpc.rendezvous.state import DecisionKind, RdzvParams, Waiter, decide, usable_count


def _w(n: int, *, t: float = 0.0, active: bool = False) -> list[Waiter]:
    return [Waiter(agent_id=f"a{i}", joined_at=t + i * 0.01, was_active=active) for i in range(n)]


P = RdzvParams(min_nodes=2, max_nodes=4, last_call_s=3.0, timeout_s=60.0)


@pytest.mark.parametrize(
    ("waiting", "alive", "initial", "now", "kind", "chosen"),
    [
        (1, 1, True, 1.0, DecisionKind.WAIT, 0),  # below MIN
        (2, 2, True, 1.0, DecisionKind.WAIT, 0),  # MIN reached: last call running
        (2, 2, True, 3.5, DecisionKind.COMPLETE, 2),  # last call over
        (4, 4, True, 0.1, DecisionKind.COMPLETE, 4),  # MAX: at once
        (5, 5, True, 0.1, DecisionKind.COMPLETE, 4),  # more than MAX: one is a spare
        (3, 3, False, 0.1, DecisionKind.COMPLETE, 3),  # re-rendezvous, everyone waits: at once
        (3, 4, False, 0.1, DecisionKind.WAIT, 0),  # re-rendezvous, one may still come
        (1, 1, True, 61.0, DecisionKind.TIMEOUT, 0),  # below MIN for the whole timeout
    ],
)
def test_decide_table(waiting, alive, initial, now, kind, chosen) -> None:  # type: ignore[no-untyped-def]
    d = decide(params=P, waiting=_w(waiting), alive=alive, initial=initial, opened_at=0.0, now=now)
    assert d.kind is kind
    assert len(d.chosen) == chosen


def test_wait_reports_when_to_look_again() -> None:
    d = decide(params=P, waiting=_w(2), alive=3, initial=True, opened_at=0.0, now=1.0)
    assert d.kind is DecisionKind.WAIT
    assert d.wake_at == pytest.approx(3.01)


def test_previous_participants_are_kept_over_new_spares() -> None:
    old = _w(3, t=0.0, active=True)
    spare = [Waiter(agent_id="spare", joined_at=-5.0)]  # joined earlier, but was a spare
    d = decide(
        params=RdzvParams(min_nodes=3, max_nodes=3),
        waiting=spare + old,
        alive=4,
        opened_at=0.0,
        now=0.0,
    )
    assert d.kind is DecisionKind.COMPLETE
    assert set(d.chosen) == {"a0", "a1", "a2"}


def test_node_unit_rounds_down() -> None:
    p = RdzvParams(min_nodes=2, max_nodes=8, node_unit=2)
    assert usable_count(p, 5) == 4
    assert usable_count(p, 9) == 8
    d = decide(params=p, waiting=_w(3), alive=3, initial=False, opened_at=0.0, now=0.0)
    assert d.kind is DecisionKind.COMPLETE and len(d.chosen) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_nodes": 3, "max_nodes": 2}, "1 <= MIN <= MAX"),
        ({"min_nodes": 0, "max_nodes": 2}, "1 <= MIN <= MAX"),
        ({"min_nodes": 3, "max_nodes": 3, "node_unit": 2}, "no multiple of node unit 2"),
    ],
)
def test_params_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RdzvParams(**kwargs)


def test_a_slow_previous_participant_keeps_its_place_until_the_last_call() -> None:
    """Four wait (three of the last round and a spare) while the fourth of the last round is
    still stopping its workers: completing at MAX now would swap it for the spare and cost its
    memory checkpoint, so the round waits for it, but no longer than the last call."""
    waiting = [*_w(3, t=10.0, active=True), Waiter(agent_id="spare", joined_at=1.0)]
    kw = {"params": P, "waiting": waiting, "alive": 5, "opened_at": 10.0, "returning": 1}
    d = decide(**kw, now=10.5)  # type: ignore[arg-type]
    assert d.kind is DecisionKind.WAIT and d.wake_at == pytest.approx(13.02)
    assert decide(**kw, now=13.1).chosen == ("a0", "a1", "a2", "spare")  # type: ignore[arg-type]
    nobody_late = decide(**{**kw, "returning": 0}, now=10.5)  # type: ignore[arg-type]
    assert nobody_late.kind is DecisionKind.COMPLETE
