"""Live node states (issue 48 item 2): the pure decisions, one row per case, on states parsed
from ``scontrol -o show node`` output captured on the local Slurm; then the watch driven
through the real Job and its handlers (only the clock is ours)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from dlrover_hpc.config import MasterConfig
from dlrover_hpc.errors import SlurmError
from dlrover_hpc.localslurm import LocalSlurm
from dlrover_hpc.master import decisions as d
from dlrover_hpc.master import node_states as ns
from dlrover_hpc.master.assembly import build_master
from dlrover_hpc.master.cluster import Cluster, NoCluster, Site, SlurmCluster, SshCluster
from dlrover_hpc.master.hangs import HangWatch
from dlrover_hpc.master.journal import EventLog
from dlrover_hpc.master.node_states import Changed, NodeStateWatch, Verdict
from dlrover_hpc.master.nodes import NodeRecord, NodeState
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.slurm.parse import SlurmNode, parse_show_nodes
from dlrover_hpc.values import NodeRange

from .test_job import Harness, run
from .test_server import FakeStores

DATA = Path(__file__).parents[1] / "data" / "slurm"


def _shown(name: str) -> dict[str, SlurmNode]:
    return parse_show_nodes((DATA / name).read_text())


# ------------------------------------------------------------------------ verdict
@pytest.mark.parametrize(
    ("name", "node", "state", "expected"),
    [
        ("show_nodes_drained.txt", "node1", "ALLOCATED+DRAIN", Verdict.SWAP),  # draining
        ("show_nodes_drained.txt", "node2", "ALLOCATED", None),
        ("show_nodes_drained.txt", "node3", "MIXED+DRAIN", Verdict.SWAP),  # draining
        ("show_nodes_drained.txt", "node4", "IDLE+DRAIN", Verdict.SWAP),  # drained
        ("show_nodes_fail.txt", "node2", "ALLOCATED+FAIL", Verdict.SWAP),  # failing
        ("show_nodes_fail_down.txt", "node4", "DOWN+DRAIN", Verdict.LOST),  # down beats drain
        ("show_nodes_down_not_responding.txt", "node2", "DOWN+NOT_RESPONDING", Verdict.LOST),
        ("show_nodes_down_not_responding.txt", "node3", "DOWN", Verdict.LOST),
        ("show_nodes_down_not_responding.txt", "node1", "IDLE", None),
        ("show_nodes_resumed.txt", "node3", "MIXED", None),
        ("show_nodes_resumed.txt", "node4", "IDLE", None),
    ],
)
def test_verdict_of_each_captured_state(
    name: str, node: str, state: str, expected: Verdict | None
) -> None:
    found = _shown(name)[node]
    assert sorted(ns.slurm_state(found).split("+")) == sorted(state.split("+"))
    assert ns.verdict(found) is expected


@pytest.mark.parametrize(
    ("state", "flags", "expected"),
    [
        ("IDLE", {"NOT_RESPONDING"}, Verdict.LOST),  # slurmd silent, not yet down
        ("FAIL", set(), Verdict.SWAP),
        ("MIXED", {"COMPLETING"}, None),
        ("ALLOCATED", {"REBOOT_REQUESTED"}, None),
        ("MIXED", {"MAINTENANCE"}, None),
    ],
)
def test_verdict_of_other_states(state: str, flags: set[str], expected: Verdict | None) -> None:
    node = SlurmNode(name="n", state=state, flags=frozenset(flags), reason="")
    assert ns.verdict(node) is expected


@pytest.mark.parametrize(
    ("reason", "own"),
    [
        ("dlrover-hpc: hardware fault on rank 3: Xid 79 job 42 [root@2026-12-01T18:59:20]", True),
        ("dlrover-hpc: hardware fault on rank 3 job 421 [root@2026-12-01T18:59:20]", False),
        ("dlrover-hpc: test job 2 [root@2026-11-21T21:15:55]", False),  # another job's
        ("nhc: bad dimm job 42 [root@2026-12-01T18:59:20]", False),
        ("", False),
    ],
)
def test_own_drain_is_this_jobs_reason(reason: str, own: bool) -> None:
    assert ns.own_drain(reason, "42") is own


# ------------------------------------------------------------------------ changes
DRAINED = _shown("show_nodes_drained.txt")
FAILED_DOWN = _shown("show_nodes_fail_down.txt")
RESUMED = _shown("show_nodes_resumed.txt")
OWN = {
    "node3": SlurmNode(
        name="node3",
        state="MIXED",
        flags=frozenset({"DRAIN"}),
        reason="dlrover-hpc: 2 hangs blamed on it job 42 [root@2026-12-01T18:59:20]",
    )
}


@pytest.mark.parametrize(
    ("states", "nodes", "said", "expected"),
    [
        # each drained node once
        (DRAINED, ["node1", "node2", "node3"], {}, {"node1": Verdict.SWAP, "node3": Verdict.SWAP}),
        # already acted on: nothing again at the next look
        (DRAINED, ["node1", "node2"], {"node1": Verdict.SWAP}, {}),
        # a drained node gone down since: lost now
        (FAILED_DOWN, ["node4"], {"node4": Verdict.SWAP}, {"node4": Verdict.LOST}),
        # lost is final
        (FAILED_DOWN, ["node4"], {"node4": Verdict.LOST}, {}),
        # the job's own drain is not acted on a second time
        (OWN, ["node3"], {}, {}),
        # resumed: nothing (and nothing to re-admit: see the watch below)
        (RESUMED, ["node1", "node3"], {"node1": Verdict.SWAP}, {}),
        # a node Slurm did not print waits for the next look
        (DRAINED, ["node9"], {}, {}),
    ],
)
def test_changes(
    states: Mapping[str, SlurmNode],
    nodes: list[str],
    said: dict[str, Verdict],
    expected: dict[str, Verdict],
) -> None:
    found = ns.changes(states, nodes=nodes, said=said, job_id="42")
    assert {c.node: c.verdict for c in found} == expected
    for c in found:
        assert c.reason == states[c.node].reason


JUST_RESUMED = _shown("show_nodes_just_resumed.txt")  # node4: ALLOCATED+NOT_RESPONDING
DOWN_NOT_RESPONDING = _shown("show_nodes_down_not_responding.txt")  # node2: DOWN+NOT_RESP.


@pytest.mark.parametrize(
    ("states", "before", "expected"),
    [
        # NOT_RESPONDING for one look (just resumed, or a missed ping): wait for the next
        (JUST_RESUMED, frozenset(), {}),
        # ... on two looks in a row: lost
        (JUST_RESUMED, frozenset({"node4"}), {"node4": Verdict.LOST}),
        # DOWN: lost at the first look
        (DOWN_NOT_RESPONDING, frozenset(), {"node2": Verdict.LOST, "node3": Verdict.LOST}),
    ],
)
def test_not_responding_counts_on_two_looks_in_a_row(
    states: Mapping[str, SlurmNode], before: frozenset[str], expected: dict[str, Verdict]
) -> None:
    nodes = ["node1", "node2", "node3", "node4"]
    found = ns.changes(states, nodes=nodes, said={}, job_id="42", unresponsive_before=before)
    assert {c.node: c.verdict for c in found} == expected
    assert ns.unresponsive(JUST_RESUMED) == {"node4"}
    assert ns.unresponsive(DOWN_NOT_RESPONDING) == set()  # down: no longer "not yet down"


def test_watched_nodes_are_the_agents_on_their_node_not_excluded() -> None:
    records = [_rec(f"a{i}", f"node{i}", state) for i, state in enumerate(NodeState)]
    watched = ns.watched_nodes(records, excluded={"node0"})
    states = {r.node: r.state for r in records}
    assert {states[n] for n in watched} == set(ns.WATCHED) - {states["node0"]}


# ------------------------------------------------------------------------ respond
def _rec(agent: str, node: str, state: NodeState, round: int = 1) -> NodeRecord:
    return NodeRecord(
        agent_id=agent,
        node=node,
        addr=node,
        nproc=1,
        slurm_node_id=None,
        topology_addr=None,
        state=state,
        rank=0,
        round=round,
    )


SWAP = Changed(
    node="node3", slurm_state="MIXED+DRAIN", reason="nhc: bad dimm", verdict=Verdict.SWAP
)
DOWN = Changed(node="node3", slurm_state="DOWN", reason="", verdict=Verdict.LOST)
WHY = "Slurm set it MIXED+DRAIN: nhc: bad dimm"


@pytest.mark.parametrize(
    ("change", "state", "round", "phase", "expected"),
    [
        # trains: out at the next step in memory
        (SWAP, NodeState.ACTIVE, 1, Phase.RUNNING, [ns.SwapAtSave("node3", WHY)]),
        # a spare or a benched node: benched while drained at once, nothing to lose
        (SWAP, NodeState.WAITING, 1, Phase.RUNNING, [ns.Park("node3", WHY)]),
        (SWAP, NodeState.BENCHED, 1, Phase.RUNNING, [ns.Park("node3", WHY)]),
        # a round forms: out of it now
        (SWAP, NodeState.WAITING, 1, Phase.RESTARTING, [ns.Park("node3", WHY)]),
        # an active record of an older round (its round re-forms) is no training node
        (SWAP, NodeState.ACTIVE, 0, Phase.RUNNING, [ns.Park("node3", WHY)]),
        # done with its part, lost or excluded: not watched, nothing to do
        (SWAP, NodeState.DONE, 1, Phase.RUNNING, []),
        (SWAP, NodeState.LOST, 1, Phase.RUNNING, []),
        # down: lost at once, whatever it does
        (DOWN, NodeState.ACTIVE, 1, Phase.RUNNING, [d.MarkLost("a3", "Slurm set it DOWN")]),
        (DOWN, NodeState.WAITING, 1, Phase.RUNNING, [d.MarkLost("a3", "Slurm set it DOWN")]),
        (DOWN, NodeState.DONE, 1, Phase.RUNNING, []),
    ],
)
def test_respond(
    change: Changed, state: NodeState, round: int, phase: Phase, expected: list[object]
) -> None:
    records = [_rec("a1", "node1", NodeState.ACTIVE), _rec("a3", "node3", state, round)]
    assert ns.respond(change, records, phase=phase, round=1) == expected
    # drained before in this job and resumed since: a second drain excludes it for good
    again = [d.Exclude(a.node, a.reason) if isinstance(a, ns.Park) else a for a in expected]
    assert ns.respond(change, records, phase=phase, round=1, again=True) == again


@pytest.mark.parametrize(
    ("now", "said", "expected"),
    [
        (
            "show_nodes_resumed.txt",
            {"node3": Verdict.SWAP, "node4": Verdict.SWAP},
            ["node3", "node4"],
        ),
        ("show_nodes_drained.txt", {"node3": Verdict.SWAP, "node2": Verdict.SWAP}, ["node2"]),
        # lost stays lost; a node Slurm did not print waits for the next look
        ("show_nodes_resumed.txt", {"node3": Verdict.LOST, "node9": Verdict.SWAP}, []),
        # down (drained or not) is no lifted drain
        ("show_nodes_fail_down.txt", {"node4": Verdict.SWAP}, []),
    ],
)
def test_lifted_drains(now: str, said: dict[str, Verdict], expected: list[str]) -> None:
    assert ns.lifted(_shown(now), said=said, job_id="7") == expected


@pytest.mark.parametrize(
    ("now", "said", "expected"),
    [
        # lost, then up again in Slurm (ALLOCATED, IDLE): watched afresh; a drain is no loss
        (
            "show_nodes_resumed.txt",
            {"node2": Verdict.LOST, "node4": Verdict.LOST},
            ["node2", "node4"],
        ),
        ("show_nodes_resumed.txt", {"node3": Verdict.SWAP}, []),
        # still down, or drained now (a drain is news only once it is watched afresh)
        ("show_nodes_down_not_responding.txt", {"node2": Verdict.LOST, "node3": Verdict.LOST}, []),
        ("show_nodes_drained.txt", {"node1": Verdict.LOST}, []),
        # a node Slurm did not print waits for the next look
        ("show_nodes_resumed.txt", {"node9": Verdict.LOST}, []),
    ],
)
def test_recovered_nodes(now: str, said: dict[str, Verdict], expected: list[str]) -> None:
    assert ns.recovered(_shown(now), said=said) == expected


# ------------------------------------------------------------------------ swap_due
PENDING = ns.Pending(reason=WHY, wait=d.ScaleUpWait(since=100.0, after_step=40))


@pytest.mark.parametrize(
    ("steps", "committed", "now", "due"),
    [
        ((38, 41), 30, 101.0, None),  # every rank holds 38 at most: not newer than 40
        (None, 30, 101.0, None),  # not every rank reported yet
        ((41, 42), 30, 101.0, "every rank saved step 41 or later to memory"),
        ((38, 45), 45, 101.0, "step 45 committed"),
        (
            (38, 41),
            30,
            100.0 + ns.SWAP_WAIT_MAX_S,
            f"no checkpoint within {ns.SWAP_WAIT_MAX_S:g} s",
        ),
        ((-1, 41), -1, 101.0, "the job holds no checkpoint to wait for"),
        ((-1, 41), 30, 101.0, None),  # a committed step: the job checkpoints
    ],
)
def test_swap_due(
    steps: tuple[int, int] | None, committed: int, now: float, due: str | None
) -> None:
    assert ns.swap_due(PENDING, steps=steps, committed=committed, now=now) == due


# ------------------------------------------------------------------------ the watch
class Reader:
    """What ``scontrol -o show node`` prints now (a captured file), and each call's nodes."""

    def __init__(self, states: Mapping[str, SlurmNode] | None = None) -> None:
        self.states = states or {}
        self.calls: list[list[str]] = []
        self.error: SlurmError | None = None

    def __call__(self, nodes: Sequence[str]) -> Mapping[str, SlurmNode]:
        self.calls.append(list(nodes))
        if self.error is not None:
            raise self.error
        return self.states


def _setup(h: Harness, tmp: Path, reader: Reader) -> tuple[HangWatch, NodeStateWatch]:
    hangs = HangWatch(h.job, lambda a, msg: None, tmp)
    watch = NodeStateWatch(h.job, lambda a, msg: h.pushed.append((a, msg)), reader)
    straggler_swap = h.job.on_round_opening
    assert straggler_swap is not None

    def opening() -> None:  # as the assembly chains them
        straggler_swap()
        watch.round_opening()

    h.job.on_round_opening = opening
    return hangs, watch


def _beat(h: Harness, hangs: HangWatch, agents: list[str], step: int, saved: int) -> None:
    """One heartbeat of every rank of the running round: at ``step``, ``saved`` in memory."""
    for agent in agents:
        rec = h.job.nodes[agent]
        if rec.state is not NodeState.ACTIVE or rec.assignment is None:
            continue
        progress = [
            m.RankProgress(
                rank=rec.assignment.rank_offset + lr, step=step, stalled_s=0.0, saved_step=saved
            )
            for lr in range(rec.nproc)
        ]
        hangs.heartbeat(rec.node, progress)


def _drained_out(h: Harness, node: str) -> bool:
    """Every agent of ``node`` is benched for its drain (it waits there, out of the rounds)."""
    recs = [r for r in h.job.nodes.values() if r.node == node]
    return bool(recs) and all(r.state is NodeState.BENCHED and r.drained for r in recs)


async def _look(watch: NodeStateWatch, reader: Reader, h: Harness) -> None:
    """One poll as the loop makes it (the reader in a thread)."""
    nodes = ns.watched_nodes(list(h.job.nodes.values()), h.job.excluded_nodes)
    await watch._poll(nodes)


async def _node3_drained(
    h: Harness, tmp: Path, *, saved: int
) -> tuple[Reader, list[str], HangWatch, NodeStateWatch]:
    """node1-3 train at step 10 (``saved``: the step every rank holds in memory); one look
    finds node3 MIXED+DRAIN."""
    reader = Reader({"node3": DRAINED["node3"]})
    agents = h.start("node1", "node2", "node3")
    hangs, watch = _setup(h, tmp, reader)
    _beat(h, hangs, agents, step=10, saved=saved)
    await _look(watch, reader, h)
    return reader, agents, hangs, watch


def test_a_drained_node_is_swapped_at_the_next_step_in_memory_and_a_spare_once_resumed(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="3:3")
        reader = Reader(RESUMED)
        agents = h.start("node1", "node2", "node3")
        spare = h.join("node4")
        h.wait(spare)
        hangs, watch = _setup(h, tmp_path, reader)
        _beat(h, hangs, agents, step=40, saved=40)
        await _look(watch, reader, h)
        assert reader.calls == [["node1", "node2", "node3", "node4"]]  # one call, every node
        assert not h.events("node_state_changed")
        reader.states = {**RESUMED, "node3": DRAINED["node3"]}  # node3: MIXED+DRAIN
        await _look(watch, reader, h)
        [changed] = h.events("node_state_changed")
        assert changed["node"] == "node3" and changed["slurm_state"] == "MIXED+DRAIN"
        assert changed["reason"] == "admin drain test [root@2026-12-01T18:59:20]"
        assert changed["action"] == "swapped out at the next step every rank holds in memory"
        assert h.job.phase is Phase.RUNNING  # not before a newer step is in memory
        _beat(h, hangs, agents, step=43, saved=40)
        watch.check_swaps()
        assert h.job.phase is Phase.RUNNING
        _beat(h, hangs, agents, step=45, saved=45)
        watch.check_swaps()
        assert _drained_out(h, "node3") and "node3" not in h.job.excluded_nodes
        assert h.job.phase is Phase.SHRINKING
        told = [msg for a, msg in h.pushed if a == agents[2] and isinstance(msg, m.RoundChanged)]
        assert told and "benched: Slurm set it MIXED+DRAIN: admin drain test" in told[-1].reason
        assert h.removed == []  # already drained: no second scontrol drain, no quarantine
        # the spare takes its place in the next round; node3's agent waits on its node
        h.rejoin(agents)
        h.settle(1.5)
        assert h.job.phase is Phase.RUNNING
        assert sorted(n.node for n in h.job.participants()) == ["node1", "node2", "node4"]
        assert not h.waits[agents[2]].done() and _drained_out(h, "node3")
        # a round short of MIN does not take a drained node back: node4 is lost, 2 of MIN 3
        h.job.apply([d.MarkLost(spare, "test: gone")])
        h.rejoin(agents[:2])
        h.settle(1.5)
        assert h.job.phase is not Phase.RUNNING and _drained_out(h, "node3")
        # drained still: no second event; resumed: a hot spare again, and the round forms
        await _look(watch, reader, h)
        assert len(h.events("node_state_changed")) == 1
        reader.states = RESUMED
        await _look(watch, reader, h)
        assert "node3" in reader.calls[-1]  # benched, not excluded: still watched
        back = h.events("node_state_changed")[-1]
        assert back["node"] == "node3" and back["slurm_state"] == "MIXED"
        assert back["action"] == "back as a hot spare: its drain was lifted"
        h.settle(1.5)
        assert h.job.phase is Phase.RUNNING
        assert sorted(n.node for n in h.job.participants()) == ["node1", "node2", "node3"]
        # drained a second time in this job: excluded for good (a node that flaps)
        h.wait(h.join("node5"))  # a spare to take its place
        reader.states = {**RESUMED, "node3": DRAINED["node3"]}
        _beat(h, hangs, agents, step=60, saved=60)
        await _look(watch, reader, h)
        _beat(h, hangs, agents, step=65, saved=65)
        watch.check_swaps()
        assert "node3" in h.job.excluded_nodes
        assert h.job.nodes[agents[2]].state is NodeState.EXCLUDED
        assert h.events("node_state_changed")[-1]["action"] == (
            "swapped out for good: drained a second time in this job"
        )

    run(body)


def test_a_down_node_is_lost_at_once_and_watched_afresh_once_back(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        reader = Reader(_shown("show_nodes_down_not_responding.txt"))  # node2: DOWN+NOT_RESP.
        agents = h.start("node1", "node2", "node4")
        hangs, watch = _setup(h, tmp_path, reader)
        _beat(h, hangs, agents, step=10, saved=10)
        await _look(watch, reader, h)
        [changed] = h.events("node_state_changed")
        assert changed["node"] == "node2" and changed["action"] == "lost at once"
        [lost] = h.events("node_lost")
        assert lost["node"] == "node2" and "Slurm set it DOWN+NOT_RESPONDING" in lost["reason"]
        assert h.job.nodes[agents[1]].state is NodeState.LOST
        assert h.job.phase is Phase.SHRINKING
        await _look(watch, reader, h)  # lost is not watched any more: nothing again
        assert len(h.events("node_state_changed")) == 1
        # Soak seed 1: node3 crashed (lost), came back through a replacement job and trained;
        # an admin drain of it 160 s later went unseen (its loss was remembered as final)
        back = h.join("node2")  # its replacement's agent: a hot spare
        h.wait(back)
        reader.states = RESUMED  # node2 ALLOCATED again
        await _look(watch, reader, h)
        assert "node2" in reader.calls[-1] and "node2" not in watch.said
        assert len(h.events("node_state_changed")) == 1  # coming back is no state change
        drained = SlurmNode(
            name="node2", state="ALLOCATED", flags=frozenset({"DRAIN"}), reason="admin drain"
        )
        reader.states = {**RESUMED, "node2": drained}
        await _look(watch, reader, h)
        changed = h.events("node_state_changed")[-1]
        assert changed["node"] == "node2" and changed["slurm_state"] == "ALLOCATED+DRAIN"
        rec = h.job.nodes[back]  # a spare drained: benched at once, waiting on its node
        assert rec.state is NodeState.BENCHED and rec.drained

    run(body)


def test_a_node_not_responding_for_two_looks_is_lost_one_look_is_nothing(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="1:3")
        reader = Reader({**RESUMED, "node4": JUST_RESUMED["node4"]})
        agents = h.start("node1", "node4")
        _, watch = _setup(h, tmp_path, reader)
        await _look(watch, reader, h)
        reader.states = RESUMED  # it answered again
        await _look(watch, reader, h)
        reader.states = {**RESUMED, "node4": JUST_RESUMED["node4"]}
        await _look(watch, reader, h)
        assert not h.events("node_state_changed") and h.job.phase is Phase.RUNNING
        await _look(watch, reader, h)  # still not responding
        [changed] = h.events("node_state_changed")
        assert changed["slurm_state"] == "ALLOCATED+NOT_RESPONDING"
        assert h.job.nodes[agents[1]].state is NodeState.LOST

    run(body)


def test_a_drained_node_waiting_for_its_swap_goes_down(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        reader = Reader({"node4": _shown("show_nodes_fail.txt")["node4"]})  # IDLE+DRAIN
        agents = h.start("node1", "node2", "node4")
        hangs, watch = _setup(h, tmp_path, reader)
        _beat(h, hangs, agents, step=10, saved=10)
        await _look(watch, reader, h)
        assert "node4" in watch.pending and h.job.phase is Phase.RUNNING
        reader.states = {"node4": FAILED_DOWN["node4"]}  # DOWN+DRAIN
        await _look(watch, reader, h)
        assert [e["action"] for e in h.events("node_state_changed")] == [
            "swapped out at the next step every rank holds in memory",
            "lost at once",
        ]
        assert not watch.pending and h.job.nodes[agents[2]].state is NodeState.LOST

    run(body)


def test_a_drained_spare_is_benched_at_once_and_training_goes_on(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="3:3")
        reader = Reader({"node4": DRAINED["node4"]})  # IDLE+DRAIN: the spare
        h.start("node1", "node2", "node3")
        spare = h.join("node4")
        h.wait(spare)
        _, watch = _setup(h, tmp_path, reader)
        await _look(watch, reader, h)
        assert _drained_out(h, "node4") and h.job.spares() == 0
        assert h.job.phase is Phase.RUNNING and not watch.pending
        assert not h.waits[spare].done()  # its agent waits on its node, no hot spare
        [changed] = h.events("node_state_changed")
        assert changed["action"] == "benched while drained"

    run(body)


def test_a_drain_lifted_before_the_swap_leaves_the_node_training(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        reader, agents, hangs, watch = await _node3_drained(h, tmp_path, saved=5)
        assert "node3" in watch.pending
        reader.states = RESUMED  # an admin's mistake, undone
        await _look(watch, reader, h)
        assert not watch.pending and h.job.phase is Phase.RUNNING
        assert h.events("node_state_changed")[-1]["action"] == "trains on: its drain was lifted"
        _beat(h, hangs, agents, step=20, saved=20)
        watch.check_swaps()
        assert h.job.phase is Phase.RUNNING
        assert h.job.nodes[agents[2]].state is NodeState.ACTIVE

    run(body)


def test_a_round_reopening_while_the_swap_waits_leaves_the_drained_node_out(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        _reader, agents, _hangs, watch = await _node3_drained(h, tmp_path, saved=10)
        assert "node3" in watch.pending
        h.job.apply([d.OpenRound(Phase.RESTARTING, "a worker failed")])
        assert _drained_out(h, "node3") and not watch.pending
        assert h.job.phase is Phase.RESTARTING  # one round, not a second one for the swap
        h.rejoin(agents[:2])
        h.settle(1.5)
        assert sorted(n.node for n in h.job.participants()) == ["node1", "node2"]

    run(body)


def test_a_drained_node_trains_on_while_the_job_would_fall_below_min(tmp_path: Path) -> None:
    """Soak seed 3: an admin drained one of MIN 3 training nodes with no spare; swapping it out
    stopped the whole job (2 of MIN 3) for 300 s and requeued it.  It trains on, through a
    round that re-opens, and is swapped out at the next step in memory once a spare is there
    (not at once because its bound ran out while it waited)."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="3:4")
        _reader, agents, hangs, watch = await _node3_drained(h, tmp_path, saved=10)
        assert "node3" in watch.pending
        _beat(h, hangs, agents, step=20, saved=20)
        h.clock.now += ns.SWAP_WAIT_MAX_S + 5
        watch.check_swaps()
        assert h.job.phase is Phase.RUNNING and not _drained_out(h, "node3")
        assert watch.pending["node3"].held
        h.job.apply([d.OpenRound(Phase.RESTARTING, "a worker failed")])
        assert not _drained_out(h, "node3") and "node3" in watch.pending
        h.rejoin(agents)
        h.settle(1.5)
        assert h.job.phase is Phase.RUNNING
        assert sorted(n.node for n in h.job.participants()) == ["node1", "node2", "node3"]
        h.clock.now += ns.SWAP_WAIT_MAX_S + 5
        watch.check_swaps()  # held still
        spare = h.join("node4")
        h.wait(spare)
        watch.check_swaps()  # a node to take its place: now it waits for a newer step in memory
        assert h.job.phase is Phase.RUNNING and not _drained_out(h, "node3")
        _beat(h, hangs, agents, step=25, saved=25)
        watch.check_swaps()
        assert _drained_out(h, "node3") and h.job.phase is Phase.SHRINKING

    run(body)


def test_a_job_that_saves_no_checkpoint_swaps_at_once(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        _reader, _agents, _hangs, _watch = await _node3_drained(h, tmp_path, saved=-1)
        assert _drained_out(h, "node3") and h.job.phase is Phase.SHRINKING

    run(body)


def test_a_swap_waits_at_most_its_bound(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        _reader, _agents, _hangs, watch = await _node3_drained(h, tmp_path, saved=5)
        h.clock.now += ns.SWAP_WAIT_MAX_S - 1
        watch.check_swaps()
        assert h.job.phase is Phase.RUNNING
        h.clock.now += 1
        watch.check_swaps()
        assert _drained_out(h, "node3") and h.job.phase is Phase.SHRINKING

    run(body)


def test_a_node_the_master_drained_itself_is_not_acted_on_again(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        reader = Reader(OWN)  # node3 drained with this job's reason
        agents = h.start("node1", "node2", "node3")
        _, watch = _setup(h, tmp_path, reader)
        await _look(watch, reader, h)
        assert not h.events("node_state_changed") and h.job.phase is Phase.RUNNING
        # excluded by the master (a hardware fault), then drained: not even asked about
        h.job.apply([d.Exclude("node3", "hardware fault"), d.RemoveNode("node3", "hw")])
        assert ns.watched_nodes(list(h.job.nodes.values()), h.job.excluded_nodes) == [
            "node1",
            "node2",
        ]
        assert agents

    run(body)


def test_a_failing_scontrol_backs_off_and_never_raises(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        reader = Reader()
        reader.error = SlurmError("scontrol show node node[1-2] failed: slurm_load_node error")
        h.start("node1", "node2")
        _, watch = _setup(h, tmp_path, reader)
        for failures in (1, 2, 3, 4, 5):
            await _look(watch, reader, h)
            wait = min(ns.POLL_BACKOFF_MAX_S, ns.POLL_EVERY_S * 2**failures)
            assert watch.failures == failures
            assert watch._next_poll == pytest.approx(h.clock.now + wait)
        reader.error = None
        await _look(watch, reader, h)
        assert watch.failures == 0
        assert watch._next_poll == pytest.approx(h.clock.now + ns.POLL_EVERY_S)

    run(body)


def test_a_slow_scontrol_does_not_stall_the_loop(tmp_path: Path) -> None:
    """The look runs in a thread: the event loop answers meanwhile, and one look at a time."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        h.start("node1", "node2")
        release = asyncio.Event()
        loop = asyncio.get_running_loop()

        def slow(nodes: Sequence[str]) -> Mapping[str, SlurmNode]:
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(timeout=30)
            return RESUMED

        watch = NodeStateWatch(h.job, lambda a, msg: None, slow)
        task = asyncio.create_task(watch.run())
        ticks = 0
        while not watch._polling and ticks < 100:
            await asyncio.sleep(0.05)
            ticks += 1
        assert watch._polling
        for _ in range(5):  # the loop runs while the look waits
            await asyncio.sleep(0.01)
        release.set()
        while watch._polling:
            await asyncio.sleep(0.05)
        assert len(watch.poll_s) == 1
        task.cancel()

    run(body)


@pytest.mark.parametrize(
    ("cluster", "watched"),
    [(SlurmCluster(job_id="7"), True), (NoCluster(), False), (SshCluster(), False)],
)
def test_only_a_job_under_slurm_watches_its_nodes_states(
    tmp_path: Path, cluster: Cluster, watched: bool
) -> None:
    """The Cluster seam: bare metal (the SSH launcher) and a master outside Slurm ask no one."""
    config = MasterConfig(nnodes=NodeRange.parse("1:2"), job_id="7")
    master = build_master(config, cluster, job_dir=tmp_path, stores=FakeStores())
    assert (master.node_states is not None) is watched
    if watched:  # chained after the straggler swap's hook
        assert master.job.on_round_opening is not master.hangs.round_opening


def test_an_unexpected_error_reading_states_is_logged_and_the_watch_goes_on(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        agents = h.start("node1", "node3")

        def broken(nodes: Sequence[str]) -> Mapping[str, SlurmNode]:
            raise OSError("fork failed: Resource temporarily unavailable")

        watch = NodeStateWatch(h.job, lambda a, msg: None, broken)
        await watch._poll(["node1", "node3"])
        assert watch.failures == 1 and not watch._polling
        watch._read = Reader({"node3": DRAINED["node3"]})
        await watch._poll(["node1", "node3"])
        assert watch.failures == 0 and "node3" in watch.pending
        assert agents

    run(body)


def test_a_state_change_of_a_node_whose_agents_left_says_nothing(tmp_path: Path) -> None:
    """Its agent was lost between the look's start and its answer: nothing to act on, and no
    event claiming an action."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="1:3")
        agents = h.start("node1", "node3")
        watch = NodeStateWatch(h.job, lambda a, msg: None, Reader())
        h.job.apply([d.MarkLost(agents[1], "no heartbeat")])
        watch.seen({"node3": DRAINED["node3"]}, ["node1", "node3"])
        assert not h.events("node_state_changed") and "node3" not in watch.said

    run(body)


def test_the_slurm_clusters_reader_on_the_local_slurm(
    local_slurm: LocalSlurm, tmp_path: Path
) -> None:
    """The reader a Slurm job's master polls with, against the real scontrol: one call for
    the four nodes, a drained one's verdict and reason, and nothing once it is resumed."""
    site = Site(
        config=MasterConfig(nnodes=NodeRange.parse("1:4"), job_id="7"),
        job_dir=tmp_path,
        events=EventLog(tmp_path / "events.jsonl"),
    )
    read = SlurmCluster(job_id="7").node_states(site)
    assert read is not None
    nodes = ["node1", "node2", "node3", "node4"]
    reason = "test: live node states"
    subprocess.run(
        ["scontrol", "update", "nodename=node4", "state=drain", f"reason={reason}"],
        check=True,
        timeout=30,
    )
    try:
        states = read(nodes)
        assert sorted(states) == nodes
        assert ns.verdict(states["node4"]) is Verdict.SWAP
        assert states["node4"].reason.startswith(f"{reason} [root@")
        [change] = ns.changes(states, nodes=nodes, said={}, job_id="7")
        assert change.node == "node4" and "DRAIN" in change.slurm_state
    finally:
        subprocess.run(["scontrol", "update", "nodename=node4", "state=resume"], timeout=30)
    assert ns.changes(read(nodes), nodes=nodes, said={}, job_id="7") == []
