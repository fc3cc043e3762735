"""When the master starts a new agent on a node the job still holds: the pure plan, by table."""

from __future__ import annotations

import pytest

from dlrover_hpc.master import relaunch_plan as rp
from dlrover_hpc.master.decisions import Relaunch
from dlrover_hpc.master.nodes import NodeRecord, NodeState

W, A, LOST, X = NodeState.WAITING, NodeState.ACTIVE, NodeState.LOST, NodeState.EXCLUDED
ARGV = ("python", "-m", "dlrover_hpc.cli.run", "train.py")


def rec(name: str, state: NodeState, *, n: int = 1, argv: tuple[str, ...] = ARGV) -> NodeRecord:
    return NodeRecord(
        agent_id=f"{name}-{n}",
        node=name,
        addr=name,
        nproc=1,
        slurm_node_id=None,
        topology_addr=None,
        state=state,
        launch_argv=argv,
    )


def timed_out(name: str) -> NodeRecord:
    r = rec(name, LOST)
    r.link_timed_out = True
    return r


ALLOC = {"node1": "alloc", "node2": "alloc", "node3": "alloc", "node4": "mix"}
NOW = 1000.0


def plan(records, *, allocation=ALLOC, attempts=None, excluded=()):  # type: ignore[no-untyped-def]
    return rp.relaunches(
        records, excluded_nodes=excluded, allocation=allocation, attempts=attempts or {}, now=NOW
    )


def test_a_lost_agent_on_a_healthy_allocated_node_is_relaunched() -> None:
    records = [rec("node1", A), rec("node2", A), rec("node3", LOST)]
    assert plan(records) == [Relaunch("node3", "node3-1", 1)]


@pytest.mark.parametrize(
    ("why", "records", "kwargs"),
    [
        ("no longer the job's", [rec("node3", LOST)], {"allocation": {"node1": "alloc"}}),
        ("not responding", [rec("node3", LOST)], {"allocation": {"node3": "alloc*"}}),
        ("set down", [rec("node3", LOST)], {"allocation": {"node3": "down"}}),
        ("draining", [rec("node3", LOST)], {"allocation": {"node3": "drng"}}),
        ("excluded (faulty)", [rec("node3", LOST)], {"excluded": ("node3",)}),
        ("its agent came back", [rec("node3", LOST), rec("node3", W, n=2)], {}),
        (
            "its agent waits benched (a straggler's node): a new one would replace it",
            [rec("node3", LOST), rec("node3", NodeState.BENCHED, n=2)],
            {},
        ),
        ("no command line known", [rec("node3", LOST, argv=())], {}),
        ("its link timed out: the agent may reconnect", [timed_out("node3")], {}),
        (
            "a relaunch is in flight",
            [rec("node3", LOST)],
            {"attempts": {"node3": rp.Relaunching(started_at=NOW - 5)}},
        ),
        (
            "three relaunches in a row failed",
            [rec("node3", LOST)],
            {"attempts": {"node3": rp.Relaunching(failed=3, ended_at=NOW - 100)}},
        ),
        (
            "backing off after a failure",
            [rec("node3", LOST)],
            {"attempts": {"node3": rp.Relaunching(failed=2, ended_at=NOW - 9)}},
        ),
    ],
)
def test_no_relaunch(why: str, records: list[NodeRecord], kwargs: dict) -> None:
    assert plan(records, **kwargs) == [], why


def test_retry_after_the_back_off_and_a_stale_attempt_is_not_in_flight() -> None:
    attempts = {"node3": rp.Relaunching(failed=2, ended_at=NOW - 10.5)}  # back-off 10 s
    assert plan([rec("node3", LOST)], attempts=attempts) == [Relaunch("node3", "node3-1", 3)]
    stale = {"node3": rp.Relaunching(started_at=NOW - rp.RELAUNCH_JOIN_S - 1)}
    assert plan([rec("node3", LOST)], attempts=stale) == [Relaunch("node3", "node3-1", 1)]


def test_every_lost_node_is_relaunched_even_at_max_to_wait_as_a_spare() -> None:
    """A spare took the lost node's place: the job is at MAX, and the node is still the job's.
    Its new agent waits as the next hot spare (node2's relaunch is already in flight)."""
    records = [rec("node1", A), rec("node2", LOST), rec("node3", LOST), rec("node4", LOST)]
    attempts = {"node2": rp.Relaunching(started_at=NOW - 1)}
    assert plan(records, attempts=attempts) == [
        Relaunch("node3", "node3-1", 1),
        Relaunch("node4", "node4-1", 1),
    ]


@pytest.mark.parametrize(
    ("state", "usable"),
    [
        ("alloc", True),
        ("mix", True),
        ("idle", True),
        ("comp", True),
        ("alloc*", False),
        ("idle~", False),
        ("down", False),
        ("down*", False),
        ("drain", False),
        ("drng", False),
        ("fail", False),
        ("maint", False),
    ],
)
def test_slurm_usable(state: str, usable: bool) -> None:
    assert rp.slurm_usable(state) is usable


def test_book_joined_resets_and_ended_counts_only_unjoined() -> None:
    book = rp.RelaunchBook()
    book.started("node3", NOW)
    assert book.in_flight(NOW + 1) == 1
    book.joined("node3")
    assert book.in_flight(NOW + 1) == 0
    assert book.ended("node3", NOW + 2) is False  # its agent joined: a normal end
    book.started("node3", NOW + 3)
    assert book.ended("node3", NOW + 4) is True
    assert book.attempts["node3"] == rp.Relaunching(failed=1, ended_at=NOW + 4)


def test_book_judging_holds_only_until_the_allocation_was_seen_or_for_ten_seconds() -> None:
    book = rp.RelaunchBook()
    assert not book.judging(NOW)  # nothing lost
    book.last_loss_at = NOW
    assert book.judging(NOW + 1)
    assert not book.judging(NOW + rp.JUDGE_MAX_S)  # Slurm never answered: stop holding
    book.allocation_at = NOW + 0.5
    assert not book.judging(NOW + 1)
