"""--segment with a block topology, through the job executor: rounds in whole segments, a spare
of the lost node's block first, and the segment that moves when that block has none."""

from __future__ import annotations

from pathlib import Path

from dlrover_hpc import topology as topo
from dlrover_hpc.master.nodes import NodeState
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.protocol import messages as m
from tests.master.test_job import Harness, run

BLOCKS = topo.loads("BlockName=b1 Nodes=n[1-3]\nBlockName=b2 Nodes=n[4-7]\nBlockSizes=2\n")


def _lose(h: Harness, agents: dict[str, str], node: str) -> None:
    """``node``'s agent drops and stays away past the grace; the others keep beating."""
    h.agents.disconnected(agents.pop(node))
    h.clock.now += 3.5
    for agent in agents.values():
        h.agents.heartbeat(m.Heartbeat(agent_id=agent, round=h.job.round))
    h.agents.check_liveness()


def test_segments_follow_blocks_spares_by_block_and_the_segment_moves(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="4:4", topology=BLOCKS, segment=2, heartbeat_timeout_s=5.0)
        nodes = ["n7", "n3", "n5", "n1", "n6", "n2", "n4"]  # join order is not rank order
        agents = {n: h.join(n) for n in nodes}
        for a in agents.values():
            h.wait(a)
        h.settle(1.5)
        assert h.job.phase is Phase.RUNNING and h.job.round == 1
        first = h.events("rendezvous_complete")[-1]
        assert first["nodes"] == ["n1", "n2", "n4", "n5"]
        assert first["blocks"] == ["b1", "b1", "b2", "b2"] and first["segment"] == 2

        _lose(h, agents, "n2")  # b1 still has a free node: n3 takes n2's place
        h.rejoin([agents[n] for n in ("n1", "n4", "n5")])
        h.settle()
        assert h.job.round == 2 and h.job.phase is Phase.RUNNING
        second = h.events("rendezvous_complete")[-1]
        assert second["nodes"] == ["n1", "n3", "n4", "n5"]
        assert [e["node"] for e in h.events("node_admitted")] == ["n3"]  # not b2's n6 or n7

        _lose(h, agents, "n3")  # b1 has no free node left: its segment moves to b2's spares
        h.rejoin([agents[n] for n in ("n1", "n4", "n5")])
        h.settle()
        assert h.job.round == 3 and h.job.phase is Phase.RUNNING
        third = h.events("rendezvous_complete")[-1]
        assert third["nodes"] == ["n4", "n5", "n6", "n7"]
        assert third["blocks"] == ["b2"] * 4
        assert [e["node"] for e in h.events("node_admitted")] == ["n3", "n6", "n7"]
        states = {r.node: r.state for r in h.agents.status().nodes if r.node in agents}
        assert states.pop("n1") is not NodeState.ACTIVE  # n1 waits as a spare
        assert set(states.values()) == {NodeState.ACTIVE}

    run(body)


def test_a_spare_that_completes_no_segment_does_not_scale_the_round_up(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:4", topology=BLOCKS, segment=2, scale_up_wait_s=0.0)
        running = h.start("n1", "n2")
        assert h.events("rendezvous_complete")[-1]["nodes"] == ["n1", "n2"]
        for node in ("n3", "n4"):  # b1's odd node and a lone b2 node: no new segment
            h.wait(h.join(node))
        h.settle(5.0)
        assert h.job.round == 1 and h.job.phase is Phase.RUNNING
        h.wait(h.join("n5"))  # b2 now holds a segment: the round grows by it
        h.settle()
        assert h.job.phase is Phase.RENDEZVOUS
        h.rejoin(running)
        h.settle()
        assert h.job.round == 2 and h.job.phase is Phase.RUNNING
        assert h.events("rendezvous_complete")[-1]["nodes"] == ["n1", "n2", "n4", "n5"]

    run(body)
