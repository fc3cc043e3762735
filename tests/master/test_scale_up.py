"""A node that could join the running job waits for the next checkpoint (issue 26): the real
Job, its handlers and the HangWatch that reads the ranks' saved steps; only the clock is ours."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrover_hpc.master import decisions as d
from dlrover_hpc.master.handlers import AgentHandlers
from dlrover_hpc.master.hangs import HangWatch
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.protocol import messages as m

from .test_job import Harness, run


def _watched(tmp_path: Path, **config: object) -> tuple[Harness, HangWatch]:
    h = Harness(tmp_path, nnodes="2:3", **config)
    watch = HangWatch(h.job, lambda agent, msg: None, tmp_path)
    h.agents = AgentHandlers(h.job, watch)  # heartbeats reach the watch, as in the server
    return h, watch


def _beat(h: Harness, agents: list[str], step: int, saved: int) -> None:
    """Every rank of ``agents`` at ``step``, with ``saved`` its newest step in memory."""
    for agent in agents:
        rec = h.job.nodes[agent]
        first = rec.rank * rec.nproc
        progress = [
            m.RankProgress(rank=r, step=step, stalled_s=0.0, saved_step=saved)
            for r in range(first, first + rec.nproc)
        ]
        h.agents.heartbeat(m.Heartbeat(agent_id=agent, round=h.job.round, progress=progress))


def _returning(h: Harness, agents: list[str]) -> str:
    """n3 joins the job that runs n1, n2 at steps saved to memory; returns n3's agent."""
    _beat(h, agents, step=40, saved=35)
    late = h.join("n3")
    h.wait(late)
    return late


def test_a_returning_node_waits_for_every_rank_to_save_a_newer_step(tmp_path: Path) -> None:
    async def body() -> None:
        h, _ = _watched(tmp_path)
        agents = h.start("n1", "n2")
        late = _returning(h, agents)
        wake = h.job.step()
        assert h.job.phase is Phase.RUNNING  # not now: steps 36-40 would be redone
        assert wake is not None and wake <= h.clock.now + 1.0
        _beat(h, agents[:1], step=44, saved=42)  # one node saved past step 40, not the other
        h.settle(0.5)
        assert h.job.phase is Phase.RUNNING
        _beat(h, agents[1:], step=43, saved=42)
        h.settle(0.5)
        assert h.job.phase is Phase.RENDEZVOUS
        h.rejoin(agents)
        h.settle()
        assert h.job.phase is Phase.RUNNING and h.waits[late].result().nnodes == 3
        [admitted] = h.events("node_admitted")
        assert admitted["node"] == "n3" and admitted["deferred"] is True
        assert admitted["deferred_s"] == 1.0

    run(body)


def test_a_commit_also_ends_the_wait(tmp_path: Path) -> None:
    async def body() -> None:
        h, _ = _watched(tmp_path)
        agents = h.start("n1", "n2")
        _returning(h, agents)
        h.settle()
        assert h.job.phase is Phase.RUNNING
        h.job.last_committed = 40  # committed, but not after the node came: waits on
        h.settle(0.5)
        assert h.job.phase is Phase.RUNNING
        h.job.last_committed = 45
        h.settle(0.5)
        assert h.job.phase is Phase.RENDEZVOUS

    run(body)


def test_a_fault_while_the_node_waits_takes_it_in_with_one_restart(tmp_path: Path) -> None:
    """The fault's round re-forms with the waiting node: one stall for both, not two."""

    async def body() -> None:
        h, _ = _watched(tmp_path)
        agents = h.start("n1", "n2")
        late = _returning(h, agents)
        h.settle()
        assert h.job.phase is Phase.RUNNING
        h.job.apply([d.OpenRound(Phase.RESTARTING, "worker failed on n2")])
        h.rejoin(agents)
        h.settle()
        assert h.job.phase is Phase.RUNNING and h.job.round == 2
        assert h.waits[late].result().nnodes == 3
        [admitted] = h.events("node_admitted")
        assert admitted["deferred"] is True
        assert len(h.events("rendezvous_complete")) == 2  # the first round, and this one
        h.settle(400)  # nothing left to take in: no further round
        assert h.job.round == 2 and h.job.phase is Phase.RUNNING

    run(body)


@pytest.mark.parametrize(
    ("wait_s", "saved", "why"),
    [
        (300.0, -1, "the job saves no checkpoint the master sees"),
        (0.0, 35, "--scale-up-wait=0"),
    ],
)
def test_the_node_joins_at_once(tmp_path: Path, wait_s: float, saved: int, why: str) -> None:
    async def body() -> None:
        h, _ = _watched(tmp_path, scale_up_wait_s=wait_s)
        agents = h.start("n1", "n2")
        _beat(h, agents, step=40, saved=saved)
        h.wait(h.join("n3"))
        h.settle()
        assert h.job.phase is Phase.RENDEZVOUS, why
        h.rejoin(agents)
        h.settle()
        [admitted] = h.events("node_admitted")
        assert admitted["deferred"] is False and "deferred_s" not in admitted

    run(body)


def test_the_wait_ends_after_scale_up_wait_without_a_checkpoint(tmp_path: Path) -> None:
    async def body() -> None:
        h, _ = _watched(tmp_path, scale_up_wait_s=60.0)
        agents = h.start("n1", "n2")
        _returning(h, agents)
        h.settle()
        _beat(h, agents, step=90, saved=35)  # training on, no newer save
        h.settle(59.0)
        assert h.job.phase is Phase.RUNNING
        wake = h.job.step()
        assert wake == pytest.approx(h.clock.now + 0.5)
        h.settle(1.0)
        assert h.job.phase is Phase.RENDEZVOUS

    run(body)


@pytest.mark.parametrize(
    ("saved", "committed", "elapsed", "expected"),
    [
        (40, -1, 1.0, None),  # saved at the step it came: may hold steps it has not saved
        (41, -1, 1.0, "every rank saved step 41 or later to memory"),
        (None, 41, 1.0, "step 41 committed"),
        (None, -1, 299.0, None),
        (None, -1, 300.0, "no checkpoint within 300 s"),
    ],
)
def test_scale_up_due(saved: int | None, committed: int, elapsed: float, expected: str) -> None:
    wait = d.ScaleUpWait(since=1000.0, after_step=40)
    got = d.scale_up_due(
        wait, saved=saved, committed=committed, now=1000.0 + elapsed, limit_s=300.0
    )
    assert got == expected
