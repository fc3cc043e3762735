"""The job executor driven directly: agent messages and timer ticks in, phases, pushes,
journal, events and Slurm callbacks out.  Real TCPStores and files; only the clock is ours."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from dlrover_hpc.config import MasterConfig, NodeRange
from dlrover_hpc.localslurm import wait_for
from dlrover_hpc.master.handlers import EVERY_TICK_NODES, SILENCE_PASSES, AgentHandlers
from dlrover_hpc.master.job import Job
from dlrover_hpc.master.journal import EventLog, Journal
from dlrover_hpc.master.nodes import NodeState
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.master.steps import StepLog
from dlrover_hpc.master.stopping import GracefulStop
from dlrover_hpc.master.stores import TorchStores
from dlrover_hpc.protocol import messages as m


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """One Job with its handlers; records what the job pushes and asks Slurm to do."""

    def __init__(self, tmp: Path, nnodes: str = "2:3", topology: Any = None, **config: Any) -> None:
        self.clock = Clock()
        self.pushed: list[tuple[str, m.Message]] = []
        self.removed: list[tuple[str, str]] = []
        self.replacements: list[tuple[int, list[str]]] = []
        self.requeued: list[str] = []
        self.tmp = tmp
        cfg = MasterConfig(nnodes=NodeRange.parse(nnodes), job_id="42", last_call_s=1.0, **config)
        stores = TorchStores()
        # The stores' torch import runs in the background, in real time, not on our clock: a
        # round forms only once it is done (seconds on a loaded machine, cc52).
        wait_for(stores.ready, timeout_s=120, what="torch imported for the round stores")
        self.job = Job(
            cfg,
            stores=stores,
            store_host="127.0.0.1",
            push=lambda agent, msg: self.pushed.append((agent, msg)),
            topology=topology,
            clock=self.clock,
            events=EventLog(tmp / "events.jsonl"),
            journal=Journal(tmp / "journal.jsonl"),
            remove_node=lambda node, why: self.removed.append((node, why)),
            request_replacement=lambda n, avoid: self.replacements.append((n, avoid)),
            requeue=self.requeued.append,
        )
        self.agents = AgentHandlers(self.job)
        self.waits: dict[str, asyncio.Future[m.Assignment]] = {}

    def join(self, node: str) -> str:
        reply = self.agents.join(m.Join(node=node, addr=node, nproc=2))
        return reply.agent_id

    def wait(self, agent: str, after: int = 0) -> None:
        self.waits[agent] = self.agents.wait_round(m.WaitRound(agent_id=agent, after_round=after))

    def settle(self, seconds: float = 0.0) -> None:
        self.clock.now += seconds
        self.job.step()

    def events(self, name: str) -> list[dict[str, Any]]:
        lines = (self.tmp / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == name]

    def start(self, *nodes: str) -> list[str]:
        """Join ``nodes``, wait past the last call: round 1 runs them."""
        agents = [self.join(n) for n in nodes]
        for a in agents:
            self.wait(a)
        self.settle(1.5)
        assert self.job.phase is Phase.RUNNING
        return agents

    def rejoin(self, agents: list[str]) -> None:
        for a in agents:
            self.wait(a, after=self.job.round)


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(body())


def test_first_round_ranks_and_assigns(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path)
        a, b = h.join("n1"), h.join("n2")
        h.wait(a)
        h.settle()
        assert h.job.phase is Phase.WAITING  # below MIN
        h.wait(b)
        h.settle(0.5)
        assert h.job.phase is Phase.WAITING  # MIN reached, but below MAX: the last call runs
        h.settle(1.0)
        assert h.job.phase is Phase.RUNNING and h.job.round == 1
        got = {agent: fut.result() for agent, fut in h.waits.items()}
        assert [g.node_rank for g in got.values()] == [0, 1]
        assert [g.rank_offset for g in got.values()] == [0, 2]
        assert {g.world_size for g in got.values()} == {4}
        assert {g.status for g in got.values()} == {m.NodeStatus.ACTIVE}
        assert h.events("rendezvous_complete")[0]["nodes"] == ["n1", "n2"]
        assert Journal(tmp_path / "journal.jsonl").load()["round"] == 1
        rows = h.agents.status().nodes
        assert [(r.node, r.rank, r.state) for r in rows] == [
            ("n1", 0, NodeState.ACTIVE),
            ("n2", 1, NodeState.ACTIVE),
        ]

    run(body)


def test_worker_failure_restarts_the_round_and_charges_once(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, max_restarts=1)
        agents = h.start("n1", "n2")
        for agent, rank in ((agents[0], 0), (agents[1], 2)):  # both report: charged once
            h.agents.worker_failed(
                m.WorkerFailed(
                    agent_id=agent,
                    round=1,
                    local_rank=0,
                    rank=rank,
                    exit_code=1,
                    signal=None,
                    classification="software",
                    reason="boom",
                )
            )
        assert h.job.phase is Phase.RESTARTING and h.job.restart_count == 1
        assert sorted(a for a, msg in h.pushed if isinstance(msg, m.RoundChanged)) == agents
        h.rejoin(agents)
        h.settle(1.5)
        assert h.job.phase is Phase.RUNNING and h.job.round == 2
        assert h.events("workers_restarted")[0]["restart_count"] == 1
        # The second failure exceeds --max-restarts=1: the job fails.
        h.agents.worker_failed(_failure(agents[0], round=2, kind="software", signal="SIGSEGV"))
        assert h.job.phase is Phase.FAILED and h.job.exit_code == 1
        assert h.events("job_finished")[0]["reason"].endswith("1 restarts are used up")

    run(body)


def test_hardware_fault_excludes_drains_and_shrinks_without_charging(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path)
        agents = h.start("n1", "n2", "n3")
        h.agents.worker_failed(
            m.WorkerFailed(
                agent_id=agents[2],
                round=1,
                local_rank=1,
                rank=5,
                exit_code=1,
                signal=None,
                classification="hardware",
                reason="Xid 79",
            )
        )
        assert h.job.phase is Phase.SHRINKING and h.job.restart_count == 0
        assert h.removed == [("n3", "hardware fault on rank 5: Xid 79")]
        assert h.job.excluded_nodes == {"n3"}
        # The excluded node's agent hears so; a new agent on that node is refused too.
        h.wait(agents[2], after=1)
        assert h.waits[agents[2]].result().status is m.NodeStatus.EXCLUDED
        h.rejoin(agents[:2])
        h.settle(1.5)
        assert h.job.phase is Phase.RUNNING and h.events("rendezvous_complete")[-1]["nodes"] == [
            "n1",
            "n2",
        ]
        again = h.join("n3")
        h.wait(again)
        assert h.waits[again].result().status is m.NodeStatus.EXCLUDED

    run(body)


def test_lost_node_shrinks_replaces_then_requeues_below_min(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:2", min_nodes_timeout_s=30.0, heartbeat_timeout_s=5.0)
        a, _ = h.start("n1", "n2")
        h.clock.now += 4.0
        h.agents.heartbeat(m.Heartbeat(agent_id=a, round=1))
        h.clock.now += 2.0  # b silent for 6 s > 5 s
        h.agents.check_liveness()
        assert h.job.phase is Phase.SHRINKING
        assert [e["node"] for e in h.events("node_lost")] == ["n2"]
        h.rejoin([a])
        h.agents.check_capacity()
        # n2's agent is lost: only live agents' nodes (and faulty ones) are avoided here; the
        # Replacer adds the nodes Slurm still counts as this job's.
        assert h.replacements == [(1, ["n1"])]
        assert h.job.phase is Phase.REPLACING
        h.clock.now += 29.0
        h.agents.check_capacity()
        assert not h.requeued
        h.clock.now += 1.0
        h.agents.check_capacity()
        assert h.requeued == ["fewer than 2 nodes for 30 s"]
        assert h.job.phase is Phase.FAILED and h.job.exit_code == 1

    run(body)


def test_replacement_arrives_in_time_and_is_admitted(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:2", heartbeat_timeout_s=5.0)
        a, b = h.start("n1", "n2")
        h.agents.disconnected(b)
        h.clock.now += 3.5  # past the reconnect grace
        h.agents.heartbeat(m.Heartbeat(agent_id=a, round=1))
        h.agents.check_liveness()
        h.rejoin([a])
        h.agents.check_capacity()
        assert h.job.phase is Phase.REPLACING
        c = h.join("n9")
        h.wait(c)
        h.settle()
        assert h.job.phase is Phase.RUNNING and h.job.round == 2
        assert [e["node"] for e in h.events("node_admitted")] == ["n9"]
        h.agents.check_capacity()
        assert not h.requeued and len(h.replacements) == 1

    run(body)


def test_all_workers_succeed_and_spares_are_told(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:2")
        a, b = h.start("n1", "n2")
        spare = h.join("n3")
        h.wait(spare)
        h.settle()
        assert not h.waits[spare].done()  # a hot spare keeps waiting
        h.agents.workers_succeeded(m.WorkersSucceeded(agent_id=a, round=1))
        assert h.job.phase is Phase.RUNNING
        h.agents.workers_succeeded(m.WorkersSucceeded(agent_id=b, round=1))
        assert h.job.phase is Phase.FINISHED and h.job.exit_code == 0
        assert h.waits[spare].result().status is m.NodeStatus.FINISHED
        assert h.agents.heartbeat(m.Heartbeat(agent_id=a, round=1)).finished

    run(body)


def _scale_up(h: Harness) -> tuple[list[str], str]:
    """n1 and n2 train; n3 joins late and the master opens a round for it: (the two, n3)."""
    agents = h.start("n1", "n2")
    late = h.join("n3")
    h.wait(late)
    h.settle()
    assert h.job.phase is Phase.RENDEZVOUS
    return agents, late


def test_scale_up_takes_in_a_late_node(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        agents, late = _scale_up(h)
        h.rejoin(agents)
        h.settle()
        assert h.job.phase is Phase.RUNNING and h.job.round == 2 and h.job.restart_count == 0
        assert h.waits[late].result().nnodes == 3

    run(body)


def test_a_node_done_as_a_scale_up_opens_joins_the_new_round(tmp_path: Path) -> None:
    """Its workers ended as the round re-opened: its success comes first, its wait a moment
    later, after the others' (CI on a4b9ecc formed the round without it)."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        (a, b), _ = _scale_up(h)
        h.agents.workers_succeeded(m.WorkersSucceeded(agent_id=a, round=1))
        h.rejoin([b])
        h.settle()
        assert h.job.phase is Phase.RENDEZVOUS  # the done node is waited for
        h.rejoin([a])
        h.settle()
        assert h.job.phase is Phase.RUNNING and h.job.round == 2
        assert {n.node for n in h.job.participants()} == {"n1", "n2", "n3"}
        assert h.waits[a].result().round == 2

    run(body)


@pytest.mark.parametrize("first", [True, False])
def test_stop_signal_fails_the_job_from_any_live_phase(tmp_path: Path, first: bool) -> None:
    async def body() -> None:
        h = Harness(tmp_path)
        if not first:
            h.start("n1", "n2")
        h.job.request_stop("SIGTERM")
        h.settle()
        assert h.job.phase is Phase.FAILED and h.job.exit_code == 143
        h.job.finish(0, "late")  # an ended job stays ended
        assert h.job.phase is Phase.FAILED and h.job.exit_code == 143

    run(body)


def _failure(agent: str, *, round: int, kind: str, signal: str | None = None) -> m.WorkerFailed:
    return m.WorkerFailed(
        agent_id=agent,
        round=round,
        local_rank=0,
        rank=0,
        exit_code=None if signal else 1,
        signal=signal,
        classification=kind,
        reason="Connection closed by peer" if kind == "peer" else "boom",
    )


def _peer_failure(agent: str, round: int = 1) -> m.WorkerFailed:
    return _failure(agent, round=round, kind="peer")


def test_node_crash_spends_no_restart_even_with_max_restarts_0(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3", max_restarts=0)
        a, b, c = h.start("n1", "n2", "n3")
        # n3 crashes: the survivors' workers lose their peer first, then n3's link closes.
        h.agents.worker_failed(_peer_failure(a))
        h.agents.worker_failed(_peer_failure(b))
        assert h.job.phase is Phase.RESTARTING and h.job.restart_count == 0
        h.agents.disconnected(c)
        h.clock.now += 3.5
        for agent in (a, b):
            h.agents.heartbeat(m.Heartbeat(agent_id=agent, round=1))
        h.agents.check_liveness()
        assert [e["node"] for e in h.events("node_lost")] == ["n3"]
        h.rejoin([a, b])
        h.settle(20.0)  # long past the grace: nothing is charged
        assert h.job.phase is Phase.RUNNING and h.job.round == 2
        assert h.job.restart_count == 0 and not h.events("job_finished")
        assert h.waits[a].result().restart_count == 0  # a membership change, no failure

    run(body)


def test_a_peer_failure_with_no_node_lost_is_charged_after_the_grace(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:2", max_restarts=1)
        a, b = h.start("n1", "n2")
        h.agents.worker_failed(_peer_failure(a))
        assert h.job.restart_count == 0
        h.rejoin([a, b])
        h.settle(1.5)
        assert h.job.phase is Phase.RUNNING and h.job.restart_count == 0  # restarted at once
        # The workers are told it is a restart, as torchrun tells them after a failure.
        assert h.waits[a].result().restart_count == 1
        assert h.events("workers_restarted")[-1]["restart_count"] == 1
        h.settle(9.0)  # the grace has run out and no node left
        assert h.job.restart_count == 1 and h.job.phase is Phase.RUNNING
        assert Journal(tmp_path / "journal.jsonl").load()["restart_count"] == 1
        h.agents.worker_failed(_peer_failure(a, round=2))
        h.settle(10.0)
        assert h.job.phase is Phase.FAILED
        assert h.events("job_finished")[0]["reason"].endswith("1 restarts are used up")

    run(body)


def test_reconnected_agent_keeps_its_place_or_is_readmitted_once_lost(tmp_path: Path) -> None:
    """Issue 12 item 2: a connection that drops and comes back before the agent is given up
    changes nothing; after it was lost, the agent comes back as a waiting node
    (``node_readmitted``) and is admitted at the next rendezvous, with the same agent id."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3", heartbeat_timeout_s=5.0)
        a, b, c = h.start("n1", "n2", "n3")
        h.agents.disconnected(c)
        h.clock.now += 1.0  # within the reconnect grace
        again = h.agents.join(m.Join(node="n3", addr="n3", nproc=2, agent_id=c))
        assert again.agent_id == c
        h.clock.now += 5.0
        for agent in (a, b, c):
            h.agents.heartbeat(m.Heartbeat(agent_id=agent, round=1))
        h.agents.check_liveness()
        assert h.job.nodes[c].state is NodeState.ACTIVE and h.job.round == 1
        assert h.events("node_readmitted") == [] and h.events("node_lost") == []

        h.agents.disconnected(c, link_timed_out=True)  # the link is cut: lost at once
        h.agents.check_liveness()
        assert h.job.nodes[c].state is NodeState.LOST
        h.rejoin([a, b])
        h.settle(2.0)
        assert h.job.round == 2 and h.events("rendezvous_complete")[-1]["nodes"] == ["n1", "n2"]
        h.agents.join(m.Join(node="n3", addr="n3", nproc=2, agent_id=c))  # the link is back
        assert h.job.nodes[c].state is NodeState.WAITING
        assert [(e["node"], e["agent"]) for e in h.events("node_readmitted")] == [("n3", c)]
        hb = h.agents.heartbeat(m.Heartbeat(agent_id=c, round=1))
        assert hb.round == 2  # its old round is over: it stops its workers and waits
        h.wait(c, after=1)
        h.job.step()  # running below MAX with a node waiting: scale up
        h.rejoin([a, b])
        h.settle(2.0)
        assert h.job.round == 3
        assert sorted(h.events("rendezvous_complete")[-1]["nodes"]) == ["n1", "n2", "n3"]

    run(body)


@pytest.mark.parametrize(
    ("looked", "holds_n3", "readmitted"),
    [
        ("after the loss", False, False),  # Slurm took n3 out of the job: its step is ended
        ("after the loss", True, True),  # the link came back before SlurmdTimeout
        ("before the loss", False, True),  # no look since: nothing says it left
    ],
)
def test_an_agent_whose_node_slurm_took_out_of_the_job_is_told_to_exit(
    tmp_path: Path, looked: str, holds_n3: bool, readmitted: bool
) -> None:
    """A cut link outlasting SlurmdTimeout: Slurm takes the node out of the ``--no-kill``
    job and ends the agent's step there once slurmd registers again.  Readmitted meanwhile,
    the agent trained a round and died in it (two more stalls in the soak); it exits."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3", heartbeat_timeout_s=5.0)
        a, b, c = h.start("n1", "n2", "n3")
        h.job.relaunching_possible = True  # under Slurm
        if looked == "before the loss":
            h.job.relaunches.allocation_at = h.clock.now
            h.job.relaunches.allocation = {"n1": "alloc", "n2": "alloc"}
        h.clock.now += 1.0
        h.agents.disconnected(c, link_timed_out=True)
        assert h.job.nodes[c].state is NodeState.LOST
        if looked == "after the loss":
            h.clock.now += 1.0
            h.job.relaunches.allocation_at = h.clock.now
            held = ["n1", "n2", "n3"] if holds_n3 else ["n1", "n2"]
            h.job.relaunches.allocation = dict.fromkeys(held, "alloc")
        h.rejoin([a, b])
        h.settle(2.0)
        h.agents.join(m.Join(node="n3", addr="n3", nproc=2, agent_id=c))  # the link is back
        assert bool(h.events("node_readmitted")) is readmitted
        h.wait(c, after=1)
        if readmitted:
            assert h.job.nodes[c].state is NodeState.WAITING and not h.waits[c].done()
        else:
            assert h.job.nodes[c].state is NodeState.LOST
            assignment = h.waits[c].result()
            assert assignment.status is m.NodeStatus.EXCLUDED
            assert "Slurm took node n3 out of this job" in assignment.reason

    run(body)


def test_a_lost_agent_of_an_excluded_node_is_not_readmitted(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3", heartbeat_timeout_s=5.0)
        _a, _b, c = h.start("n1", "n2", "n3")
        h.job.exclude("n3", "failed the network check")
        h.agents.join(m.Join(node="n3", addr="n3", nproc=2, agent_id=c))
        assert h.job.nodes[c].state is NodeState.EXCLUDED
        assert h.events("node_readmitted") == []
        h.wait(c, after=1)
        assert h.waits[c].result().status is m.NodeStatus.EXCLUDED

    run(body)


def test_the_round_does_not_wait_for_an_agent_whose_connection_dropped(tmp_path: Path) -> None:
    """An agent SIGKILLed: its peers' workers fail at once, its connection closed a moment
    earlier.  The survivors' round forms without waiting out its reconnect grace (it would
    re-join if it came back)."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3", heartbeat_timeout_s=5.0)
        a, b, c = h.start("n1", "n2", "n3")
        h.agents.disconnected(c)
        h.agents.worker_failed(_peer_failure(a))
        h.rejoin([a, b])
        h.settle(0.1)  # well within the 3 s grace: c is not lost yet
        assert h.job.nodes[c].state is not NodeState.LOST and not h.events("node_lost")
        assert h.job.phase is Phase.RUNNING and h.job.round == 2
        assert h.events("rendezvous_complete")[-1]["nodes"] == ["n1", "n2"]

    run(body)


def test_status_of_a_large_job_is_a_summary_unless_every_node_is_asked_for(
    tmp_path: Path,
) -> None:
    """Past SUMMARY_OVER nodes, ``dlrover-hpc status`` gets the counts by state and the rows
    worth a look (the slowest running nodes, those not running), not one row per node."""
    from dlrover_hpc.cli.status import format_status

    async def body() -> None:
        h = Harness(tmp_path, nnodes="40:40")
        agents = [h.join(f"n{i:02d}") for i in range(41)]  # 40 run, 1 waits as a spare
        for a in agents:
            h.wait(a)
        h.settle(1.5)
        assert h.job.phase is Phase.RUNNING
        full = h.agents.status(m.StatusRequest(nodes=True))
        assert len(full.nodes) == 41 and not full.summary
        summary = h.agents.status(m.StatusRequest(nodes=False))
        assert summary.summary and summary.node_states == {"active": 40, "waiting": 1}
        # the 5 slowest running nodes (no step yet: rank order) and the waiting one
        assert [r.node for r in summary.nodes] == ["n00", "n01", "n02", "n03", "n04", "n40"]
        text = format_status(summary)
        assert "nodes: 41 (active 40, waiting 1)" in text and "--nodes" in text
        assert len(text.splitlines()) == 4 + len(summary.nodes)

    run(body)


# ------------------------------------------------------------------ crash-loop guard (issue 48)
SEGV = "the worker crashed with SIGSEGV; no hardware error was logged [signal SIGSEGV (11)]"


def _steps(h: Harness, agents: list[str], step: int) -> None:
    """Every rank of the running round reports ``step`` (a heartbeat per agent)."""
    for agent in agents:
        first = h.job.nodes[agent].rank * 2
        ranks = [
            m.RankProgress(rank=r, step=step, stalled_s=0.0, at=1.0) for r in (first, first + 1)
        ]
        h.agents.heartbeat(m.Heartbeat(agent_id=agent, round=h.job.round, progress=ranks))


def _crash(
    h: Harness, agent: str, *, kind: str = "software", reason: str = SEGV, step: int = 4
) -> None:
    """``agent``'s first worker fails; its final report says it reached ``step`` (-1: none)."""
    rank = h.job.nodes[agent].rank * 2
    final = [m.RankProgress(rank=rank, step=step, stalled_s=0.0, at=1.0)] if step >= 0 else []
    h.agents.worker_failed(
        m.WorkerFailed(
            agent_id=agent,
            round=h.job.round,
            local_rank=0,
            rank=rank,
            exit_code=None,
            signal="SIGSEGV" if kind == "software" else None,
            classification=kind,
            reason=reason,
            progress=final,
        )
    )


def _members(h: Harness) -> list[str]:
    return [n.agent_id for n in sorted(h.job.participants(), key=lambda n: n.rank)]


def test_a_segfault_at_the_same_step_ends_as_a_crash_loop_before_the_budget(
    tmp_path: Path,
) -> None:
    """The defaults (3 rounds, 3 restarts): round 1 reaches step 4 from nothing, rounds 2-4
    no further; the 4th failure would also spend the budget: the job ends as a crash loop."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:2")
        agents = h.start("n1", "n2")
        for round in (1, 2, 3, 4):
            assert h.job.round == round and h.job.phase is Phase.RUNNING
            _steps(h, agents, 3)
            _crash(h, agents[0])
            if round < 4:
                h.rejoin(agents)
                h.settle(1.5)
        assert h.job.phase is Phase.FAILED and h.job.exit_code == 3
        [loop] = h.events("crash_loop")
        assert (loop["rounds"], loop["rank"], loop["node"]) == (3, 0, "n1")
        assert (loop["classification"], loop["error"]) == ("software", SEGV)
        assert [f["round"] for f in loop["failures"]] == [2, 3, 4]
        [finished] = h.events("job_finished")
        assert finished["exit_code"] == 3 and finished["restart_count"] == 4
        assert finished["reason"].startswith("crash loop: 3 rounds in a row (rounds 2-4)")
        assert finished["repeated_failure"] == {
            "rounds": 3,
            "round": 4,
            "node": "n1",
            "rank": 0,
            "classification": "software",
            "error": SEGV,
        }
        assert not h.job.excluded_nodes  # n1 caused every round, but MIN needs it

    run(body)


def test_a_hardware_fault_that_moves_with_the_job_ends_as_a_crash_loop(tmp_path: Path) -> None:
    """Classified as hardware, on whichever node holds rank 0: each is excluded and a spare
    takes its place, no restart is charged; today it cycles through every node."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:2", max_restarts=0)
        everyone = h.start(*(f"n{i}" for i in range(1, 8)))
        xid = "GPU Xid error [NVRM: Xid 79, GPU has fallen off the bus.]"
        for round in (1, 2, 3, 4):
            assert h.job.round == round and h.job.phase is Phase.RUNNING
            agents = _members(h)
            _steps(h, agents, 3)
            _crash(h, agents[0], kind="hardware", reason=xid)
            assert h.job.restart_count == 0 and h.job.phase is Phase.SHRINKING
            # The round re-forms with a spare; after the 4th, it is judged and stops the job.
            h.rejoin([a for a in everyone if h.job.nodes[a].state is not NodeState.EXCLUDED])
            h.settle(1.5)
        assert h.job.phase is Phase.FAILED and h.job.exit_code == 3
        [loop] = h.events("crash_loop")
        assert (loop["rounds"], loop["classification"], loop["error"]) == (3, "hardware", xid)
        assert h.events("job_finished")[0]["restart_count"] == 0
        assert len(h.job.excluded_nodes) == 4  # one per round, by the hardware rule

    run(body)


def _lose(h: Harness, agent: str) -> None:
    """``agent``'s node dies: its connection closes, the others keep heart-beating."""
    h.agents.disconnected(agent)
    h.clock.now += 3.5
    for other in _members(h):
        if other != agent:
            h.agents.heartbeat(m.Heartbeat(agent_id=other, round=h.job.round))
    h.agents.check_liveness()


def test_a_node_lost_at_the_same_point_is_excluded_then_the_loop_ends(tmp_path: Path) -> None:
    """n3 dies at the same step in every round and comes back (a relaunched agent): no
    restart is charged.  With a spare, n3 goes after its second loss and a new agent there is
    refused; with no node to spare the job stops after 3 rounds without progress."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        a, b, c = h.start("n1", "n2", "n3")
        for _ in (1, 2):
            _steps(h, [a, b, c], 3)
            _lose(h, c)
            assert h.job.phase is Phase.SHRINKING
            c = h.join("n3")  # relaunched
            h.rejoin([a, b])
            h.wait(c)
            h.settle(1.5)
        h.settle()  # round 2 was judged as the next formed: n3 left first
        assert h.job.excluded_nodes == {"n3"}
        assert h.waits[c].result().status is m.NodeStatus.EXCLUDED
        assert h.job.phase is Phase.RUNNING and h.events("rendezvous_complete")[-1]["nodes"] == [
            "n1",
            "n2",
        ]
        assert h.job.restart_count == 0

    async def at_min() -> None:
        h = Harness(tmp_path / "min", nnodes="3:3")
        a, b, c = h.start("n1", "n2", "n3")
        for round in (1, 2, 3, 4):
            assert h.job.round == round
            _steps(h, [a, b, c], 3)
            _lose(h, c)
            if round < 4:
                c = h.join("n3")
                h.rejoin([a, b])
                h.wait(c)
                h.settle(1.5)
        h.rejoin([a, b])
        h.wait(h.join("n3"))
        h.settle(1.5)
        assert h.job.phase is Phase.FAILED and h.job.exit_code == 3
        [loop] = h.events("crash_loop")
        assert (loop["node"], loop["rank"], loop["classification"]) == ("n3", 4, "node_lost")
        assert loop["error"] == "connection closed"
        assert h.job.restart_count == 0

    run(body)
    (tmp_path / "min").mkdir()
    run(at_min)


class _Continuer:
    """Our Continuer's one call that conclude makes, recorded (no Slurm)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def continue_job(self, plan: Any, kept: int) -> str:
        self.calls.append(kept)
        return "43"


@pytest.mark.parametrize("loop", [True, False])
def test_a_job_ended_by_a_crash_loop_is_never_continued(tmp_path: Path, loop: bool) -> None:
    """A time limit's stop is under way when the guard stops the job: no continuation (and
    without the crash loop, the forced end of the same stop is continued)."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:2", crash_loop_rounds=1)
        agents = h.start("n1", "n2")
        stopper = GracefulStop(h.job, StepLog(h.job.emit), lambda *_: None, lead_s=90.0)
        continuer = _Continuer()
        stopper.continuer = continuer  # type: ignore[assignment]
        stopper.request(None, "USR1")
        if loop:
            _crash(h, agents[0], step=0)  # it never trained a step: no progress
            h.rejoin(agents)
            h.settle(1.5)
            assert h.job.exit_code == 3
        else:
            h.clock.now += 1.0
            stopper.forced = True
            h.job.finish(0, "deadline reached before a save")
        assert stopper.conclude() == (None if loop else "43")
        assert continuer.calls == ([] if loop else [-1])

    run(body)


def test_a_stop_while_a_round_forms_ends_the_job_without_an_error(tmp_path: Path) -> None:
    """SIGTERM (a preemption) while the job waits below MAX for a lost node: no round trains,
    so the job ends at once with exit 0 (continued); the phase table has no way from a
    forming phase to ``finished`` (that is every worker succeeding), so it is ``failed``
    (a batch-host test's requeued run raised TransitionError here)."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:2", heartbeat_timeout_s=5.0)
        a, _ = h.start("n1", "n2")
        h.clock.now += 4.0
        h.agents.heartbeat(m.Heartbeat(agent_id=a, round=1))
        h.clock.now += 2.0
        h.agents.check_liveness()
        assert h.job.phase is Phase.SHRINKING
        stopper = GracefulStop(h.job, StepLog(h.job.emit), lambda *_: None, lead_s=90.0)
        stopper.request(None, "SIGTERM from Slurm", within_s=20.0)
        assert h.job.ended and h.job.exit_code == 0 and h.job.phase is Phase.FAILED
        [finished] = h.events("job_finished")
        assert "no round was running" in finished["reason"], finished

    run(body)


def test_a_large_job_looks_for_silent_agents_less_often_but_for_closed_links_at_once(
    tmp_path: Path,
) -> None:
    """Past EVERY_TICK_NODES, the pass over every node for silent agents runs every 16th of
    the silence timeout, not every tick; a closed connection is still lost at the first tick
    past its grace."""

    async def body() -> None:
        n = EVERY_TICK_NODES + 44
        h = Harness(tmp_path, nnodes=f"{n}:{n}", heartbeat_timeout_s=160.0)
        agents = h.start(*(f"n{i}" for i in range(n)))
        silence_s = h.job.config.heartbeat_silence_s
        pass_s = silence_s / SILENCE_PASSES
        assert pass_s >= 10.0

        def beat(skip: set[str]) -> None:
            for a in agents:
                if a not in skip:
                    h.agents.heartbeat(m.Heartbeat(agent_id=a, round=1))

        def lost() -> list[str]:
            return [e["node"] for e in h.events("node_lost")]

        h.agents.check_liveness()  # a pass over every node
        closed, silent = agents[0], agents[1]
        seen = h.job.nodes[silent].last_seen
        h.agents.disconnected(closed)
        h.clock.now += 3.1  # past the reconnect grace, long before the next pass
        beat({closed, silent})
        h.agents.check_liveness()
        assert lost() == ["n0"]
        # the silent agent: lost past the timeout, by the next pass at the latest
        while not lost()[1:]:
            h.clock.now += 0.5
            beat({closed, silent})
            h.agents.check_liveness()
            assert h.clock.now - seen <= silence_s + pass_s + 0.5, lost()
        assert lost() == ["n0", "n1"]
        assert h.clock.now - seen > silence_s

    run(body)
