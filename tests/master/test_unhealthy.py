"""An agent's node failed its health check before joining (issue 48): the master excludes it,
drains it (or not, with --drain=off), records node_unhealthy, asks for a replacement, and
shows the reason in status.  The job executor driven directly, as in test_job."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dlrover_hpc.config import DrainMode
from dlrover_hpc.master import decisions as d
from dlrover_hpc.master.nodes import NodeState
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.protocol import messages as m
from tests.master.test_job import Harness, run

WHY = "ERROR: fake nhc failure on n3"


def _unhealthy(agent: str, check: str = "program", reason: str = WHY) -> m.NodeUnhealthy:
    return m.NodeUnhealthy(agent_id=agent, check=check, reason=reason, results=["clock=ok(1ms)"])


@pytest.mark.parametrize(
    ("drain", "actions"),
    [
        (
            DrainMode.SCONTROL,
            [
                d.Exclude("n3", f"unhealthy (program): {WHY}"),
                d.RemoveNode("n3", f"unhealthy (program): {WHY}"),
            ],
        ),
        (
            DrainMode.QUARANTINE,
            [
                d.Exclude("n3", f"unhealthy (program): {WHY}"),
                d.RemoveNode("n3", f"unhealthy (program): {WHY}"),
            ],
        ),
        # --drain=off leaves Slurm's state alone, but the node still never trains
        (DrainMode.OFF, [d.Exclude("n3", f"unhealthy (program): {WHY}")]),
    ],
)
def test_decision(drain: DrainMode, actions: list[d.Action]) -> None:
    assert d.node_unhealthy("n3", "program", WHY, drain=drain) == actions


def test_unhealthy_before_the_first_round_never_trains_and_is_replaced(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        a, b, c = h.join("n1"), h.join("n2"), h.join("n3")
        h.agents.node_unhealthy(_unhealthy(c))
        assert h.removed == [("n3", f"unhealthy (program): {WHY}")]
        assert h.job.excluded_nodes == {"n3"}
        (event,) = h.events("node_unhealthy")
        assert (event["node"], event["check"], event["reason"]) == ("n3", "program", WHY)
        assert event["checks"] == ["clock=ok(1ms)"]
        h.wait(a)
        h.wait(b)
        h.settle(1.5)  # the last call: n3 is not waited for
        assert h.job.phase is Phase.RUNNING
        assert h.events("rendezvous_complete")[-1]["nodes"] == ["n1", "n2"]
        h.agents.check_capacity()
        assert h.replacements == [(1, ["n1", "n2", "n3"])]
        rows = {r.node: r for r in h.agents.status().nodes}
        assert rows["n3"].state is NodeState.EXCLUDED
        assert rows["n3"].reason == f"unhealthy (program): {WHY}"
        h.wait(c)  # an agent that asks anyway is told it is excluded
        assert h.waits[c].result().status is m.NodeStatus.EXCLUDED

    run(body)


def test_an_unhealthy_spare_leaves_the_running_round_alone(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        h.start("n1", "n2")
        spare = h.join("n3")
        h.agents.node_unhealthy(_unhealthy(spare, "storage", "checkpoint directory /x: slow"))
        assert h.job.phase is Phase.RUNNING and h.job.round == 1
        assert not [p for p in h.pushed if isinstance(p[1], m.RoundChanged)]
        assert h.job.nodes[spare].state is NodeState.EXCLUDED

    run(body)


def test_drain_off_excludes_without_draining(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3", drain=DrainMode.OFF)
        c = h.join("n3")
        h.agents.node_unhealthy(_unhealthy(c))
        assert h.removed == [] and h.job.excluded_nodes == {"n3"}

    run(body)


def test_clock_is_the_masters_wall_clock(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path)
        before = time.time()
        reply = h.agents.clock(m.ClockRequest())
        assert before <= reply.time <= time.time()

    run(body)
