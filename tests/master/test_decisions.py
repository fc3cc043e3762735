"""The master's decisions, called directly: one table row per case, no server, no clock."""

from __future__ import annotations

import pytest

from dlrover_hpc.config import DrainMode
from dlrover_hpc.master import decisions as d
from dlrover_hpc.master.nodes import NodeRecord, NodeState
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.rendezvous.state import Decision, DecisionKind, RdzvParams

W, A, DONE, LOST, X = (
    NodeState.WAITING,
    NodeState.ACTIVE,
    NodeState.DONE,
    NodeState.LOST,
    NodeState.EXCLUDED,
)


def rec(
    name: str, state: NodeState = A, *, round: int = 1, rank: int = 0, **kw: float
) -> NodeRecord:
    return NodeRecord(
        agent_id=f"{name}-1",
        node=name,
        addr=name,
        nproc=2,
        slurm_node_id=None,
        topology_addr=None,
        state=state,
        round=round,
        rank=rank,
        **kw,  # type: ignore[arg-type]
    )


def failure(*, round: int = 1, kind: str = "software", rank: int = 3) -> m.WorkerFailed:
    return m.WorkerFailed(
        agent_id="n1-1",
        round=round,
        local_rank=1,
        rank=rank,
        exit_code=1,
        signal=None,
        classification=kind,
        reason="boom",
    )


HW = "hardware fault on rank 3: boom"
RESTART = d.OpenRound(Phase.RESTARTING, "worker 3 on n1 failed")
USED_UP = d.Finish(1, "worker failed and the job's 2 restarts are used up")


@pytest.mark.parametrize(
    "msg,node_active,phase,restarts,drain,expected",
    [
        # A worker of the running round fails: charge one restart and restart the round.
        (failure(), True, Phase.RUNNING, 0, DrainMode.SCONTROL, [d.CountRestart(), RESTART]),
        (failure(), True, Phase.RUNNING, 1, DrainMode.SCONTROL, [d.CountRestart(), RESTART]),
        # ... the last one allowed is used: the job fails.
        (failure(), True, Phase.RUNNING, 2, DrainMode.SCONTROL, [d.CountRestart(), USED_UP]),
        # A report about an older round, or while the round is re-forming: nothing to charge.
        (failure(round=0), True, Phase.RUNNING, 0, DrainMode.SCONTROL, []),
        (failure(), True, Phase.RESTARTING, 0, DrainMode.SCONTROL, []),
        (failure(), False, Phase.SHRINKING, 0, DrainMode.SCONTROL, []),
        # A hardware fault excludes and drains the node; its exclusion re-forms the round,
        # which is a membership change: no restart is charged.
        (
            failure(kind="hardware"),
            True,
            Phase.RUNNING,
            0,
            DrainMode.SCONTROL,
            [d.Exclude("n1", HW), d.RemoveNode("n1", HW)],
        ),
        # ... even when a peer's failure already re-formed the round.
        (
            failure(kind="hardware"),
            False,
            Phase.RESTARTING,
            0,
            DrainMode.QUARANTINE,
            [d.Exclude("n1", HW), d.RemoveNode("n1", HW)],
        ),
        # ... and the node is no longer active (its workers died first): the restart is charged.
        (
            failure(kind="hardware"),
            False,
            Phase.RUNNING,
            0,
            DrainMode.SCONTROL,
            [d.Exclude("n1", HW), d.RemoveNode("n1", HW), d.CountRestart(), RESTART],
        ),
        # Only lost a peer: restart now, charge later unless a node turns out lost.
        (
            failure(kind="peer"),
            True,
            Phase.RUNNING,
            2,
            DrainMode.SCONTROL,
            [RESTART, d.ChargeLater("worker 3 on n1 failed")],
        ),
        (failure(kind="peer"), True, Phase.SHRINKING, 0, DrainMode.SCONTROL, []),
        # --drain off: a hardware fault is an ordinary failure.
        (
            failure(kind="hardware"),
            True,
            Phase.RUNNING,
            0,
            DrainMode.OFF,
            [d.CountRestart(), RESTART],
        ),
    ],
)
def test_worker_failed(
    msg: m.WorkerFailed,
    node_active: bool,
    phase: Phase,
    restarts: int,
    drain: DrainMode,
    expected: list[d.Action],
) -> None:
    got = d.worker_failed(
        msg,
        node="n1",
        node_active=node_active,
        phase=phase,
        round=1,
        restart_count=restarts,
        max_restarts=2,
        drain=drain,
    )
    assert got == expected


@pytest.mark.parametrize(
    "phase,states,expected",
    [
        (Phase.RUNNING, [DONE, DONE], [d.Finish(0, "all workers succeeded")]),
        (Phase.RUNNING, [DONE, A], []),
        (Phase.RUNNING, [DONE, LOST], []),
        (Phase.SHRINKING, [DONE, DONE], []),  # a node was lost meanwhile: the round re-forms
    ],
)
def test_workers_succeeded(phase: Phase, states: list[NodeState], expected: list[d.Action]) -> None:
    records = [rec(f"n{i}", s, rank=i) for i, s in enumerate(states)]
    assert d.workers_succeeded(phase, records) == expected


def test_a_job_whose_newest_step_is_not_durable_fails_naming_the_durable_step() -> None:
    a, b = rec("n0", DONE, rank=0), rec("n1", DONE, rank=1)
    # n0 drained first and read storage before n1 (the committer) wrote step 40's record.
    a.checkpoints = [m.Durability(ckpt_dir="/ck", wanted=40, durable=35)]
    b.checkpoints = [m.Durability(ckpt_dir="/ck", wanted=40, durable=40)]
    assert d.workers_succeeded(Phase.RUNNING, [a, b]) == [d.Finish(0, "all workers succeeded")]
    b.checkpoints = [m.Durability(ckpt_dir="/ck", wanted=40, durable=25, error="step 30: ENOSPC")]
    [finish] = d.workers_succeeded(Phase.RUNNING, [a, b])
    assert finish == d.Finish(
        1,
        "all workers succeeded, but checkpoint step 40 is not on storage: the newest committed "
        "in /ck is step 35 (step 30: ENOSPC); a new run resumes from it",
    )
    a.checkpoints = b.checkpoints = [m.Durability(ckpt_dir="/ck", wanted=10, durable=-1)]
    [finish] = d.workers_succeeded(Phase.RUNNING, [a, b])
    assert finish.exit_code == 1 and "is none (its persist did not finish)" in finish.reason
    a.checkpoints = b.checkpoints = []  # nothing persisted (memory only): nothing to check
    assert d.workers_succeeded(Phase.RUNNING, [a, b]) == [d.Finish(0, "all workers succeeded")]


@pytest.mark.parametrize(
    "phase,was_active,expected",
    [
        (Phase.RUNNING, True, [d.OpenRound(Phase.SHRINKING, "node n1 excluded: bad")]),
        (Phase.RUNNING, False, []),  # a spare: nothing to re-form
        (Phase.RESTARTING, True, []),  # the round re-forms already; the node is not in it
        (Phase.WAITING, False, []),
    ],
)
def test_excluded(phase: Phase, was_active: bool, expected: list[d.Action]) -> None:
    assert d.excluded(phase, "n1", "bad", was_active) == expected


@pytest.mark.parametrize(
    "phase,state,round,expected",
    [
        (Phase.RUNNING, A, 1, [d.OpenRound(Phase.SHRINKING, "node n1 lost (no heartbeat)")]),
        (Phase.RUNNING, W, 1, []),  # a hot spare
        (Phase.RUNNING, A, 0, []),  # active in an older round only
        (Phase.RESTARTING, A, 1, []),
        (Phase.RUNNING, DONE, 1, []),  # its workers had finished
    ],
)
def test_node_lost(phase: Phase, state: NodeState, round: int, expected: list[d.Action]) -> None:
    assert d.node_lost(phase, 1, rec("n1", state, round=round), "no heartbeat") == expected


def test_lost_agents_by_silence_or_disconnect() -> None:
    records = [
        rec("fresh", A, last_seen=95.0),
        rec("silent", A, last_seen=89.0),  # 11 s > the 10 s timeout
        rec("gone", W, last_seen=99.0, disconnected_at=96.0),  # 4 s > the 3 s grace
        rec("blip", W, last_seen=99.0, disconnected_at=98.0),  # reconnects within the grace
        rec("cut", A, last_seen=99.0, disconnected_at=99.5, link_timed_out=True),  # no grace
        rec("done", DONE, last_seen=0.0),
        rec("lost", LOST, last_seen=0.0),
        rec("excluded", X, last_seen=0.0),
    ]
    assert d.lost_agents(records, now=100.0, heartbeat_timeout_s=10.0) == [
        d.MarkLost("silent-1", "no heartbeat"),
        d.MarkLost("gone-1", "connection closed"),
        d.MarkLost("cut-1", "link timed out"),
    ]
    # While a round forms, a closed connection holds it up: no grace (the blip too).
    assert d.lost_agents(records, now=100.0, heartbeat_timeout_s=10.0, forming=True) == [
        d.MarkLost("silent-1", "no heartbeat"),
        d.MarkLost("gone-1", "connection closed"),
        d.MarkLost("blip-1", "connection closed"),
        d.MarkLost("cut-1", "link timed out"),
    ]
    # ... the very tick it closed, too; a master's restart still waits for re-registrations.
    closing = rec("closing", A, last_seen=100.0, disconnected_at=100.0)
    resumed = rec("resumed", A, last_seen=99.0, disconnected_at=99.0)
    resumed.resumed = True
    assert d.lost_agents([closing, resumed], now=100.0, heartbeat_timeout_s=10.0, forming=True) == [
        d.MarkLost("closing-1", "connection closed")
    ]


PARAMS = RdzvParams(min_nodes=2, max_nodes=4, node_unit=1, last_call_s=1.0, timeout_s=60.0)


@pytest.mark.parametrize(
    "states,ready,params,expected",
    [
        ([A, A], 1, PARAMS, [d.OpenRound(Phase.RENDEZVOUS, "scale up: 1 more node(s) waiting")]),
        ([A, A], 0, PARAMS, []),
        ([A, DONE], 1, PARAMS, []),  # a node already finished: never restart a finishing job
        ([A, A, A, A], 1, PARAMS, []),  # at MAX
        # node_unit 2: one more node cannot be used
        ([A, A], 1, RdzvParams(min_nodes=2, max_nodes=4, node_unit=2), []),
    ],
)
def test_scale_up(
    states: list[NodeState], ready: int, params: RdzvParams, expected: list[d.Action]
) -> None:
    participants = [rec(f"n{i}", s, rank=i) for i, s in enumerate(states)]
    assert d.scale_up(participants, ready, params) == expected


def _capacity(
    cap: d.Capacity,
    states: list[NodeState],
    *,
    phase: Phase = Phase.RUNNING,
    now: float = 100.0,
    can_replace: bool = True,
    can_requeue: bool = True,
    relaunching: int = 0,
    judging: bool = False,
) -> tuple[d.Capacity, list[d.Action]]:
    return d.capacity(
        cap,
        phase=phase,
        records=[rec(f"n{i}", s, rank=i) for i, s in enumerate(states)],
        excluded_nodes=["bad"],
        params=PARAMS,
        now=now,
        min_nodes_timeout_s=30.0,
        can_replace=can_replace,
        can_requeue=can_requeue,
        relaunching=relaunching,
        judging=judging,
    )


def test_capacity_requests_one_replacement_per_loss_avoiding_held_and_faulty_nodes() -> None:
    cap, actions = _capacity(d.Capacity(losses=1), [A, A, A, LOST])
    # n3's agent is lost: not avoided (a healthy node may come back); "bad" is faulty.
    avoid = ("bad", "n0", "n1", "n2")
    assert actions == [d.RequestReplacement(1, avoid)]
    assert cap == d.Capacity(losses=1, replaced=1)
    assert _capacity(cap, [A, A, A, LOST]) == (cap, [])  # asked once per loss
    cap, actions = _capacity(cap.lost(), [A, A, LOST, LOST])
    assert actions == [d.RequestReplacement(2, ("bad", "n0", "n1"))]


def test_capacity_refills_the_hot_spares_the_job_began_with() -> None:
    """MIN 2, MAX 4 on 5 nodes: the spare that took a lost node's place is replaced as well,
    so the next loss costs one restart again (soak seed 1: a shrink to MIN, then a scale-up
    when the returning node came, twice)."""
    five = [A, A, A, A, W]
    cap, actions = _capacity(d.Capacity(), five)
    assert actions == [] and cap.pool == 5 and cap.target(PARAMS) == 5
    # n1 lost: the spare trains in its place, and a replacement restores the spare.
    cap, actions = _capacity(cap.lost(), [A, LOST, A, A, A])
    assert actions == [d.RequestReplacement(1, ("bad", "n0", "n2", "n3", "n4"))]
    assert cap.spares_asked == 1 and cap.asking_spares and cap.pool == 5
    assert _capacity(cap, [A, LOST, A, A, A])[1] == []  # asked once
    # A node that comes back after the loss (a drain lifted) does not raise the target.
    assert _capacity(cap, [A, W, A, A, A, W]) == (cap, [])
    # Refused (every free node still the job's own): the spare is asked for again, at the
    # same count, SPARE_TRIES times in all; then the job goes on without it.
    for tries, wait in enumerate((5, 10, 20, 40), start=1):
        cap, next_action = d.replacement_failed(cap, alive=4, params=PARAMS, now=100.0)
        if tries == d.SPARE_TRIES:
            break
        assert next_action == f"retry in {wait} s for 1 hot spare(s)"
        assert _capacity(cap, [A, LOST, A, A, A], now=100.0 + wait - 0.1)[1] == []
        cap, actions = _capacity(cap, [A, LOST, A, A, A], now=100.0 + wait)
        assert actions == [d.RequestReplacement(1, ("bad", "n0", "n2", "n3", "n4"))]
    assert next_action == "no retry: go on with 4 node(s), no hot spare"
    assert _capacity(cap, [A, LOST, A, A, A], now=1e6)[1] == []
    # The spares' refusals never shrink what MAX needs: a later loss asks for MAX's node
    # alone first (a request for more than Slurm has free would wait for all of them) ...
    cap, actions = _capacity(cap.lost(), [A, LOST, LOST, A, A], now=2e6)
    assert actions == [d.RequestReplacement(1, ("bad", "n0", "n3", "n4"))]
    assert not cap.asking_spares
    # ... and the spare once MAX is back.
    cap, actions = _capacity(cap, [A, LOST, LOST, A, A, A], now=2e6)
    assert actions == [d.RequestReplacement(1, ("bad", "n0", "n3", "n4", "n5"))]
    assert cap.asking_spares
    # A job that began without a spare asks only up to MAX, as before.
    cap, actions = _capacity(d.Capacity(), [A, A, A, A])
    assert cap.pool == 4 and _capacity(cap.lost(), [A, A, A, A, LOST])[1] == []


def test_capacity_replaces_once_judging_ends_without_a_relaunch() -> None:
    cap, actions = _capacity(d.Capacity(losses=1), [A, A, A, LOST], judging=True)
    assert actions == [] and cap.replaced == 0  # the loss is still owed a replacement
    _, actions = _capacity(cap, [A, A, A, LOST])
    assert actions == [d.RequestReplacement(1, ("bad", "n0", "n1", "n2"))]


def test_a_loss_while_a_relaunch_is_in_flight_is_replaced_once_the_relaunch_fails() -> None:
    """Soak seed 1: after a refusal (one node fewer to ask for), a node lost while its agent
    was being relaunched counted as alive; the loss must still be owed when the relaunch
    fails, not settled by a request for 0 nodes (the job waited 300 s at 2 of MIN 3 and was
    requeued)."""
    cap = d.Capacity(losses=3, replaced=2, failures=1)  # MIN 2, MAX 4
    cap, actions = _capacity(cap, [A, A, LOST, LOST], relaunching=1)  # 3 alive: ask for 0
    assert actions == [] and cap.losses > cap.replaced
    cap, actions = _capacity(cap, [A, LOST, LOST, LOST])  # the relaunch failed: 1 alive
    assert actions == [d.RequestReplacement(2, ("bad", "n0"))]
    assert cap.replaced == cap.losses


def test_refused_replacements_back_off_ask_for_fewer_then_go_on_at_min() -> None:
    running = [A, A, LOST, LOST]  # MIN 2, MAX 4: two short of MAX, at MIN
    cap, actions = _capacity(d.Capacity(losses=2), running, now=100.0)
    assert actions == [d.RequestReplacement(2, ("bad", "n0", "n1"))]
    cap, next_action = d.replacement_failed(cap, alive=2, params=PARAMS, now=100.0)
    assert next_action == "retry in 5 s for 1 node(s)"
    assert _capacity(cap, running, now=104.9)[1] == []  # backing off
    cap, actions = _capacity(cap, running, now=105.0)
    assert actions == [d.RequestReplacement(1, ("bad", "n0", "n1"))]
    cap, next_action = d.replacement_failed(cap, alive=2, params=PARAMS, now=105.0)
    assert next_action == "no retry: go on with 2 node(s), at least MIN 2"
    assert _capacity(cap, running, now=1e6)[1] == []  # shrunk to MIN: no more requests
    # A later loss asks again; once the job is back at MAX the refusals are forgotten.
    cap, actions = _capacity(cap.lost(), [A, LOST, LOST, LOST], phase=Phase.SHRINKING, now=200.0)
    assert actions[0] == d.RequestReplacement(1, ("bad", "n0"))  # what MIN needs
    cap, _ = _capacity(cap, [A, A, A, A, LOST, LOST, LOST])
    assert cap.failures == 0 and cap.retry_at == 0.0


def test_refused_replacement_below_min_keeps_asking_for_what_min_needs() -> None:
    cap = d.Capacity(losses=3, replaced=3)
    for failures, wait in enumerate((5, 10, 20, 40, 60, 60), start=1):
        cap, next_action = d.replacement_failed(cap, alive=1, params=PARAMS, now=0.0)
        count = max(1, 3 - failures)
        assert next_action == f"retry in {wait} s for {count} node(s)"
        assert cap.failures == failures and cap.retry_at == wait
        assert cap.losses > cap.replaced  # asks again once the back-off ends


@pytest.mark.parametrize(
    "cap,states,kw,expected",
    [
        # Nothing lost, at MAX: nothing to do.
        (d.Capacity(), [A, A, A, A], {}, []),
        # Lost while spares cover it: at MAX again, no replacement.
        (d.Capacity(losses=1), [A, A, A, A, LOST], {}, []),
        # No replacement template: only the requeue path.
        (d.Capacity(losses=1), [A, A, LOST], {"can_replace": False}, []),
        # The job ended: nothing.
        (d.Capacity(losses=1), [A, LOST], {"phase": Phase.FAILED}, []),
        # The lost agent's node is being relaunched in the allocation: it counts as alive.
        (d.Capacity(losses=1), [A, A, A, LOST], {"relaunching": 1}, []),
        # Lost just now, the allocation not looked at yet: it may be relaunched, so wait.
        (d.Capacity(losses=1), [A, A, A, LOST], {"judging": True}, []),
    ],
)
def test_capacity_quiet_cases(
    cap: d.Capacity, states: list[NodeState], kw: dict[str, object], expected: list[d.Action]
) -> None:
    assert _capacity(cap, states, **kw)[1] == expected  # type: ignore[arg-type]


def test_capacity_below_min_replaces_then_requeues_after_the_timeout() -> None:
    below = [W, LOST, LOST, LOST]
    cap, actions = _capacity(d.Capacity(losses=3), below, phase=Phase.SHRINKING, now=100.0)
    assert cap.below_min_since == 100.0
    assert actions == [d.RequestReplacement(3, ("bad", "n0")), d.EnterPhase(Phase.REPLACING)]
    cap, actions = _capacity(cap, below, phase=Phase.REPLACING, now=129.0)
    assert actions == [] and cap.below_min_since == 100.0
    cap, actions = _capacity(cap, below, phase=Phase.REPLACING, now=130.0)
    reason = "fewer than 2 nodes for 30 s"
    assert actions == [d.Requeue(reason), d.Finish(1, f"requeued: {reason}")]
    # Back at MIN before the timeout: the timer resets.
    cap, actions = _capacity(d.Capacity(below_min_since=100.0), [W, W], phase=Phase.REPLACING)
    assert cap.below_min_since is None and actions == []
    # Without --requeue the job waits (the rendezvous timeout ends it).
    assert _capacity(cap, below, phase=Phase.REPLACING, now=1e6, can_requeue=False)[1] == []


@pytest.mark.parametrize(
    "decision,needs,expected",
    [
        (
            Decision(kind=DecisionKind.COMPLETE, chosen=("a", "b")),
            False,
            [d.CompleteRound(("a", "b"))],
        ),
        (
            Decision(kind=DecisionKind.COMPLETE, chosen=("a", "b")),
            True,
            [d.StartNetcheck(("a", "b"))],
        ),
        (Decision(kind=DecisionKind.WAIT, wake_at=12.5), False, [d.WakeAt(12.5)]),
        (Decision(kind=DecisionKind.TIMEOUT), False, [d.Finish(1, "fewer than 2 nodes for 60 s")]),
    ],
)
def test_form_round(decision: Decision, needs: bool, expected: list[d.Action]) -> None:
    assert d.form_round(decision, params=PARAMS, needs_netcheck=needs) == expected


@pytest.mark.parametrize(
    "restarts,reason,expected",
    [
        (0, "", [d.CountRestart()]),
        (0, "w failed", [d.CountRestart(), d.OpenRound(Phase.RESTARTING, "w failed")]),
        (2, "", [d.CountRestart(), USED_UP]),
    ],
)
def test_charge(restarts: int, reason: str, expected: list[d.Action]) -> None:
    assert d.charge(restart_count=restarts, max_restarts=2, reason=reason) == expected
