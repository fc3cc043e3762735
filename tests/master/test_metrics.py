"""The master's metrics: its job's state and its event log, served over real HTTP."""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from pathlib import Path

import pytest
from harness.ports import free_port

from dlrover_hpc.config import MasterConfig, NodeRange
from dlrover_hpc.events import EventName
from dlrover_hpc.localslurm import wait_for
from dlrover_hpc.master import metrics
from dlrover_hpc.master.handlers import AgentHandlers
from dlrover_hpc.master.job import Job
from dlrover_hpc.master.journal import EventLog
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.master.stores import TorchStores
from dlrover_hpc.protocol import messages as m


def _job(tmp: Path, events: EventLog, clock: list[float]) -> tuple[Job, AgentHandlers]:
    cfg = MasterConfig(nnodes=NodeRange.parse("2:2"), job_id="9", last_call_s=1.0)
    stores = TorchStores()
    wait_for(stores.ready, timeout_s=120, what="torch imported for the round stores")  # real time
    job = Job(
        cfg,
        stores=stores,
        store_host="127.0.0.1",
        push=lambda agent, msg: None,
        clock=lambda: clock[0],
        events=events,
    )
    return job, AgentHandlers(job)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def test_metrics_follow_the_job_and_its_log_over_http(tmp_path: Path) -> None:
    async def body() -> None:
        events = EventLog(tmp_path / "events.jsonl")
        events.emit(EventName.JOB_STARTED, job_id="9")
        observer = metrics.Observer(events.path)
        clock = [1000.0]
        job, agents = _job(tmp_path, events, clock)
        a = agents.join(m.Join(node="n1", addr="n1", nproc=1)).agent_id
        b = agents.join(m.Join(node="n2", addr="n2", nproc=1)).agent_id
        for agent in (a, b):
            agents.wait_round(m.WaitRound(agent_id=agent, after_round=0))
        clock[0] += 1.5
        job.step()
        assert job.phase is Phase.RUNNING
        now = time.time()
        for i, agent in enumerate((a, b)):  # each node's one rank, before its first step
            agents.heartbeat(
                m.Heartbeat(
                    agent_id=agent,
                    round=1,
                    progress=[m.RankProgress(rank=i, step=0, stalled_s=0.0, at=now)],
                )
            )
        for i in (1, 2, 3):  # 50 steps per 5 s: the median step is known from the second on
            events.emit(EventName.TRAINING_PROGRESS, round=1, step=50 * i, at=now + 5 * i)
        events.emit(EventName.CHECKPOINT_SAVED, rank=0, node="n1", step=40, blocking_s=0.004)
        events.emit(EventName.CHECKPOINT_PERSISTED, step=40, persist_s=2.5, committed=True)
        events.emit(EventName.WORKER_FAILED, node="n2", rank=1, classification="software")
        job.restart_count = 1
        port = free_port()
        stop = metrics.serve(
            metrics.JobCollector(job, observer, agents.steps), host="127.0.0.1", port=port
        )
        try:
            text = await asyncio.to_thread(_scrape, port)
        finally:
            stop()
        lines = set(text.splitlines())
        assert "dlrover_hpc_restarts_total 1.0" in lines
        assert 'dlrover_hpc_nodes{state="active"} 2.0' in lines
        assert 'dlrover_hpc_phase{phase="running"} 1.0' in lines
        assert "dlrover_hpc_round 1.0" in lines
        assert "dlrover_hpc_step 0.0" in lines  # what the heartbeats said
        assert 'dlrover_hpc_worker_failures_total{classification="software"} 1.0' in lines
        assert "dlrover_hpc_checkpoint_step 40.0" in lines
        assert 'dlrover_hpc_checkpoint_persist_seconds_bucket{le="1"} 0.0' in lines
        assert 'dlrover_hpc_checkpoint_persist_seconds_bucket{le="5"} 1.0' in lines
        assert 'dlrover_hpc_checkpoint_save_seconds_bucket{le="0.005"} 1.0' in lines
        [goodput] = [line for line in lines if line.startswith("dlrover_hpc_goodput ")]
        assert 0 < float(goodput.split()[1]) <= 1
        with pytest.raises(OSError):  # stopped: nothing listens any more
            _scrape(port)

    asyncio.run(body())


def test_a_round_waiting_for_nodes_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        clock = [1000.0]
        _, agents = _job(tmp_path, EventLog(tmp_path / "events.jsonl"), clock)
        agents.join(m.Join(node="n1", addr="n1", nproc=1))
        caplog.set_level(logging.INFO, logger="dlrover_hpc.master.handlers")
        for _ in range(4):  # 0, 6, 12, 18 s: said at 12 s only (every 10 s)
            agents.say_waiting()
            clock[0] += 6.0
        said = [r.getMessage() for r in caplog.records if "waiting for nodes" in r.message]
        assert said == [
            "waiting for nodes: 1 reachable of 2-2 wanted, 12 s in phase waiting (round 1 next)"
        ]

    asyncio.run(body())
