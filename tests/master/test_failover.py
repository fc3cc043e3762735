"""A restarted master (issue 14): epochs and the lease in a real job directory, a Job resumed
from a real journal adopting the agents' running round, and a superseded server stepping down.
Only the clock is ours."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from dlrover_hpc.config import DrainMode, MasterConfig, NodeRange, RequeueBy
from dlrover_hpc.master import failover
from dlrover_hpc.master.assembly import Master, build_master
from dlrover_hpc.master.bookkeeping import JournaledCommits
from dlrover_hpc.master.cluster import NoCluster
from dlrover_hpc.master.journal import Journal
from dlrover_hpc.master.nodes import NodeState
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.master.resume import RESUME_GRACE_S
from dlrover_hpc.master.server import SUPERSEDED, MasterServer
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.report.analysis import read_events

from .test_job import Harness, run
from .test_server import TOKEN, FakeStores


# ------------------------------------------------------------------ epochs and the lease
def test_an_epoch_is_claimed_once_and_supersedes_the_one_before(tmp_path: Path) -> None:
    assert failover.newest_epoch(tmp_path) == 0
    assert failover.claim(tmp_path, 1) and not failover.claim(tmp_path, 1)
    assert failover.take_over(tmp_path) == 2  # no lease: nobody serves
    assert failover.newest_epoch(tmp_path) == 2
    assert failover.superseded(tmp_path, 1) and not failover.superseded(tmp_path, 2)


def test_a_renewed_lease_keeps_candidates_out_and_a_stale_one_lets_them_in(
    tmp_path: Path,
) -> None:
    failover.claim(tmp_path, 1)
    failover.write_lease(tmp_path, 1)
    lease = failover.read_lease(tmp_path)
    assert lease is not None and lease.epoch == 1 and failover.lease_fresh(lease, time.time())
    with pytest.raises(failover.MasterServing, match=r"renews .*master\.lease: it serves"):
        failover.take_over(tmp_path, wait_s=0.3)
    assert failover.newest_epoch(tmp_path) == 1  # nothing claimed
    assert not failover.lease_fresh(lease, lease.time + failover.STALE_S + 0.1)
    stale = {"epoch": 1, "time": time.time() - 10, "host": "n1", "pid": 1}
    (tmp_path / failover.LEASE).write_text(json.dumps(stale))
    assert failover.take_over(tmp_path, epoch=2) == 2
    with pytest.raises(failover.MasterServing, match=r"claimed epoch 2 .* first"):
        failover.take_over(tmp_path, epoch=2)
    (tmp_path / failover.LEASE).write_text("{torn")
    assert failover.read_lease(tmp_path) is None


def test_the_first_masters_configuration_is_kept_for_a_promoted_agent(tmp_path: Path) -> None:
    assert failover.load_config(tmp_path) is None
    first = MasterConfig(
        nnodes=NodeRange(min=2, max=4),
        drain=DrainMode.QUARANTINE,
        topology="t.conf",
        port=7,
        requeue_by=RequeueBy.FRAMEWORK,
    )
    failover.save_config(tmp_path, first)
    failover.save_config(tmp_path, MasterConfig())  # a later master does not overwrite it
    got = failover.load_config(tmp_path, port=0, embedded=True)
    assert got is not None
    assert got.nnodes == NodeRange(min=2, max=4)
    assert (got.drain, got.topology) == (DrainMode.QUARANTINE, "t.conf")
    assert got.requeue_by is RequeueBy.FRAMEWORK
    assert (got.port, got.embedded) == (0, True)


# ------------------------------------------------------------------ a Job resumed from its journal
def _rejoin(
    h: Harness, agent: str, node: str, *, state: NodeState, round: int = 1, lost_at: float = 0.0
) -> None:
    h.agents.join(
        m.Join(
            node=node,
            addr=node,
            nproc=2,
            agent_id=agent,
            round=round,
            round_state=state,
            master_lost_at=lost_at,
        )
    )


def test_a_restarted_master_adopts_the_round_its_agents_train(tmp_path: Path) -> None:
    async def body() -> None:
        agents = Harness(tmp_path).start("n1", "n2")
        h = Harness(tmp_path)  # the master process was killed; a new one reads the journal
        assert (h.job.phase, h.job.round) == (Phase.RUNNING, 1)
        assert {r.state for r in h.job.nodes.values()} == {NodeState.ACTIVE}
        lost_at = time.time() - 3.0
        _rejoin(h, agents[0], "n1", state=NodeState.ACTIVE, lost_at=lost_at)
        assert not h.events("master_recovered")  # n2 has not re-registered yet
        _rejoin(h, agents[1], "n2", state=NodeState.ACTIVE, lost_at=lost_at + 0.5)
        [recovered] = h.events("master_recovered")
        assert recovered["adopted"] == ["n1", "n2"] and recovered["lost"] == []
        assert 3.0 <= recovered["downtime_s"] < 4.0
        h.settle(RESUME_GRACE_S + 1)
        h.agents.check_liveness()
        h.settle()
        assert (h.job.phase, h.job.round) == (Phase.RUNNING, 1)  # no re-rendezvous
        assert not h.pushed and h.job.restart_count == 0
        assert h.events("job_started")[-1]["resumed_round"] == 1

    run(body)


def test_a_member_that_does_not_come_back_is_lost_and_the_round_shrinks(tmp_path: Path) -> None:
    async def body() -> None:
        agents = Harness(tmp_path).start("n1", "n2", "n3")
        h = Harness(tmp_path)
        _rejoin(h, agents[0], "n1", state=NodeState.ACTIVE)
        _rejoin(h, agents[1], "n2", state=NodeState.WAITING)  # its workers died meanwhile
        h.settle(RESUME_GRACE_S - 1)
        h.agents.check_liveness()
        assert h.job.phase is Phase.RUNNING  # n3 is given the grace
        h.settle(2)
        h.agents.check_liveness()
        assert h.job.nodes[agents[2]].state is NodeState.LOST
        assert h.job.phase is Phase.SHRINKING
        [recovered] = h.events("master_recovered")
        assert (recovered["adopted"], recovered["rejoined"], recovered["lost"]) == (
            ["n1"],
            ["n2"],
            ["n3"],
        )
        [lost] = h.events("node_lost")
        assert lost["reason"] == "did not re-register with the restarted master"
        h.rejoin(agents[:2])
        h.settle(1.5)
        assert (h.job.phase, h.job.round, h.job.restart_count) == (Phase.RUNNING, 2, 0)

    run(body)


def test_an_agent_that_missed_the_rounds_start_reopens_it(tmp_path: Path) -> None:
    """The old master journaled round 1 and died before its agents heard of it."""

    async def body() -> None:
        agents = Harness(tmp_path).start("n1", "n2")
        h = Harness(tmp_path)
        for agent, node in zip(agents, ("n1", "n2"), strict=True):
            _rejoin(h, agent, node, state=NodeState.WAITING, round=0)
        h.wait(agents[0], after=0)  # the store of round 1 died with the old master
        assert h.job.phase is Phase.RESTARTING
        h.wait(agents[1], after=0)
        h.settle(1.5)
        assert (h.job.phase, h.job.round, h.job.restart_count) == (Phase.RUNNING, 2, 0)
        assert {f.result().round for f in h.waits.values()} == {2}

    run(body)


def test_members_done_before_the_restart_still_finish_the_job(tmp_path: Path) -> None:
    async def body() -> None:
        agents = Harness(tmp_path).start("n1", "n2")
        h = Harness(tmp_path)
        _rejoin(h, agents[0], "n1", state=NodeState.DONE)
        _rejoin(h, agents[1], "n2", state=NodeState.DONE)
        # n2's report was in flight when the master died: it is sent again
        h.agents.workers_succeeded(m.WorkersSucceeded(agent_id=agents[1], round=1))
        assert h.job.phase is Phase.FINISHED and h.job.exit_code == 0

    run(body)


def test_checkpoint_parts_counted_before_a_restart_still_count(tmp_path: Path) -> None:
    def part(h: Harness, ranks: list[int], step: int = 10) -> bool:
        msg = m.CheckpointPart(step=step, ranks=ranks, world_size=4, path="/ckpt")
        return h.agents.checkpoint_part(msg).commit

    async def body() -> None:
        first = Harness(tmp_path)
        first.start("n1", "n2")
        assert not part(first, [0, 1])
        assert part(first, [0, 1, 2, 3], step=8)  # committed before the restart
        h = Harness(tmp_path)
        assert part(h, [2, 3])  # completes the set begun under the old master
        assert not part(h, [0, 1, 2, 3], step=8)  # never committed twice
        loaded = Journal(tmp_path / "journal.jsonl").load()
        assert [p[1] for p in loaded["ckpt_parts"]] == [10, 8, 10, 8]

    run(body)


# ------------------------------------------------------------------ fencing
def test_a_superseded_master_steps_down_without_ending_the_job(tmp_path: Path) -> None:
    cfg = MasterConfig(host="127.0.0.1", nnodes=NodeRange(min=1, max=1), job_dir=str(tmp_path))

    async def body() -> int:
        server = MasterServer(
            build_master(cfg, NoCluster(), job_dir=tmp_path, stores=FakeStores()), token=TOKEN
        )
        assert server.master.epoch == 1
        await server.start()
        info = json.loads((tmp_path / "master.json").read_text())
        assert info["epoch"] == 1 and failover.read_lease(tmp_path) is not None
        assert failover.load_config(tmp_path) == cfg
        serving = asyncio.create_task(server.serve(linger_s=0.1))
        await asyncio.sleep(0.2)
        assert failover.claim(tmp_path, 2)  # an agent took over
        return await asyncio.wait_for(serving, 5)

    assert asyncio.run(body()) == SUPERSEDED
    assert "finished" not in Journal(tmp_path / "journal.jsonl").load()


# ------------------------------------------------------------------ torn last lines
def test_a_master_restarted_on_torn_last_lines_seals_them_and_loses_nothing(
    tmp_path: Path,
) -> None:
    """Issue 28, item 5: the old master's node lost power mid-write. Without the seal, the new
    master's first record would be glued to the torn line and skipped with it."""

    def part(h: Harness | Master, ranks: list[int], step: int) -> bool:
        msg = m.CheckpointPart(step=step, ranks=ranks, world_size=4, path="/ckpt")
        return h.agents.checkpoint_part(msg).commit

    async def body() -> None:
        first = Harness(tmp_path)
        first.start("n1", "n2")
        assert part(first, [0, 1, 2, 3], step=8)  # committed before the power loss
        assert not part(first, [0, 1], step=10)
        with open(tmp_path / "journal.jsonl", "ab") as f:
            f.write(b'{"time":1.5,"ckpt_part":["/ckpt",10,[2')  # cut mid-write
        with open(tmp_path / "events.jsonl", "ab") as f:
            f.write(b'{"time":1.5,"event":"checkpoint_sa\x00\x00\x00')
        journal_lines = len((tmp_path / "journal.jsonl").read_bytes().split(b"\n"))
        event_lines = len((tmp_path / "events.jsonl").read_bytes().split(b"\n"))

        cfg = MasterConfig(
            host="127.0.0.1", nnodes=NodeRange(min=2, max=3), job_id="42", job_dir=str(tmp_path)
        )
        server = MasterServer(
            build_master(cfg, NoCluster(), job_dir=tmp_path, stores=FakeStores()), token=TOKEN
        )
        assert server.master.job.round == 1  # resumed from the journal
        assert not part(server.master, [0, 1, 2, 3], step=8)  # step 8 stays committed, once
        assert part(server.master, [2, 3], step=10)  # the parts counted before the loss still count
        loaded = Journal(tmp_path / "journal.jsonl").load()
        # 8 and 10 before the loss, then the new master's: 8 again (refused) and 10 (parsed,
        # not glued to the torn line)
        assert [p[1] for p in loaded["ckpt_parts"]] == [8, 10, 8, 10]

        events = list(read_events(tmp_path / "events.jsonl"))  # the report reads it whole
        repaired = {e["file"]: e for e in events if e["event"] == "log_repaired"}
        assert repaired["journal.jsonl"]["line"] == journal_lines
        assert repaired["events.jsonl"]["line"] == event_lines
        assert repaired["events.jsonl"]["text"].startswith('b\'{"time":1.5')
        assert any(e["event"] == "job_started" and e.get("resumed_round") == 1 for e in events)

    run(body)


# ------------------------------------------------------------------ journal compaction
def _parts(commits: JournaledCommits, step: int, nodes: int, of: int = 0) -> None:
    """``nodes`` nodes' parts (two ranks each) of ``step``, of ``of`` nodes (all, by default)."""
    for node in range(nodes):
        commits.part_durable(
            step=step, ranks=[2 * node, 2 * node + 1], world_size=2 * (of or nodes), path="/ckpt"
        )


def test_a_compacted_journal_reads_as_the_journal_it_replaced(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path, compact_bytes=1 << 30)  # by hand first
    commits = JournaledCommits(journal)
    members = [{"agent_id": f"n{i}-1", "node": f"n{i}", "rank": i} for i in range(64)]
    for rnd in (1, 2, 3):
        journal.append(round=rnd, restart_count=rnd - 1, members=members[: 60 + rnd])
        _parts(commits, 100 * rnd, 63)  # committed
        _parts(commits, 100 * rnd + 50, 5, of=63)  # 5 of 63 nodes: still counting
    journal.append(excluded_nodes=["n7"])
    before = journal.load()
    lines = len(path.read_bytes().splitlines())
    assert journal.compact()
    assert len(path.read_bytes().splitlines()) == 1 < lines
    after = journal.load()
    # the same state, less the parts of committed steps; time is the snapshot's
    assert {k: v for k, v in after.items() if k != "time"} == {
        k: v for k, v in before.items() if k != "time"
    } | {"ckpt_parts": [p for p in before["ckpt_parts"] if p[1] == 350]}
    assert [p[1] for p in after["ckpt_parts"]] == [350] * 5
    # a restarted master counts on where the old one stopped: the other 58 parts commit 350
    again = JournaledCommits(Journal(path))
    again.replay(after["ckpt_parts"])
    for node in range(5, 62):
        assert not again.part_durable(
            step=350, ranks=[2 * node, 2 * node + 1], world_size=126, path="/ckpt"
        )
    assert again.part_durable(step=350, ranks=[124, 125], world_size=126, path="/ckpt")
    # records after a snapshot still win over it
    journal.append(restart_count=9)
    assert journal.load()["restart_count"] == 9 and journal.load()["round"] == 3


def test_the_journal_compacts_itself_and_stays_bounded(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path, compact_bytes=64 << 10)
    commits = JournaledCommits(journal)
    members = [{"agent_id": f"n{i}-1", "node": f"n{i}", "rank": i} for i in range(256)]
    sizes = []
    for rnd in range(1, 41):  # 40 rounds, each with 4 committed checkpoints of 256 nodes
        journal.append(round=rnd, restart_count=rnd, members=members)
        for k in range(4):
            _parts(commits, 1000 * rnd + k, 256)
        sizes.append(path.stat().st_size)
    # ~2 MB written in all; the snapshot (the members) is ~10 KB: the journal stays under
    # its bound, twice the snapshot + 64 KiB
    assert max(sizes) < 2 * (16 << 10) + (64 << 10)
    state = journal.load()
    assert state["round"] == 40 and state["restart_count"] == 40
    assert len(state["members"]) == 256
    # the parts since the last snapshot only (all of committed steps)
    assert 0 < len(state["ckpt_parts"]) < 4 * 256
    assert not (tmp_path / "journal.jsonl.compacting").exists()


def test_a_journal_that_grew_during_compaction_is_left_whole(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path, compact_bytes=1 << 30)
    journal.append(round=1, restart_count=0, members=[])
    real_load = journal.load

    def load_while_another_master_appends() -> dict:
        state = real_load()
        Journal(path).append(round=2, restart_count=1, members=[])  # the master that took over
        return state

    journal.load = load_while_another_master_appends  # type: ignore[method-assign]
    assert not journal.compact()
    assert Journal(path).load()["round"] == 2
    assert not (tmp_path / "journal.jsonl.compacting").exists()
