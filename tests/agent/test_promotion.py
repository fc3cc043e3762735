"""An agent taking over as master (issue 14): the order every agent computes, where an agent
connects after a restart, and the conditions under which it must not take over; the takeover
itself starts a real master in-process from a real job directory."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from dlrover_hpc.agent import promotion
from dlrover_hpc.config import MasterConfig, NodeRange
from dlrover_hpc.master import failover
from dlrover_hpc.master.journal import Journal


def _master_json(job_dir: Path, epoch: int, host: str = "n2", port: int = 5000) -> None:
    info = {"host": host, "port": port, "pid": 1, "job_id": "9", "embedded": False}
    (job_dir / "master.json").write_text(json.dumps({**info, "epoch": epoch}))


def _stale_lease(job_dir: Path, epoch: int = 1) -> None:
    lease = {"epoch": epoch, "time": time.time() - 60, "host": "n2", "pid": 1}
    (job_dir / failover.LEASE).write_text(json.dumps(lease))


def test_rank_zero_tries_first_and_agents_never_in_a_round_last() -> None:
    waits = [promotion.promote_after(rank, None) for rank in range(4)]
    assert waits == sorted(waits) and waits[0] == promotion.PROMOTE_AFTER_S
    assert len(set(waits)) == 4  # never two at once
    spare = promotion.promote_after(-1, 3)
    assert spare > promotion.promote_after(50, None) and spare != promotion.promote_after(-1, 4)


def test_an_agent_follows_master_json_only_to_a_newer_master(tmp_path: Path) -> None:
    given = ("127.0.0.1", 4000)
    assert promotion.where_master(tmp_path, given, 0) == (given, 0)  # no master.json
    _master_json(tmp_path, 1)
    assert promotion.where_master(tmp_path, given, 0) == (given, 1)  # learns the epoch only
    assert promotion.where_master(tmp_path, given, 1) == (given, 1)
    _master_json(tmp_path, 2, host="n3", port=6000)
    assert promotion.where_master(tmp_path, given, 1) == (("n3", 6000), 2)
    # the given address does not answer (a replacement job started before a fail-over)
    assert promotion.where_master(tmp_path, given, -1) == (("n3", 6000), 2)
    assert promotion.where_master(tmp_path, ("n3", 6000), -1) == (("n3", 6000), 2)


def test_an_agent_does_not_take_over_from_a_live_or_newer_master(tmp_path: Path) -> None:
    failover.claim(tmp_path, 1)
    _master_json(tmp_path, 2)  # another agent was faster
    assert promotion.try_promote(tmp_path, lost_epoch=1, token="t") is None
    _master_json(tmp_path, 1)
    failover.write_lease(tmp_path, 1)  # the master lives; only this agent cannot reach it
    assert promotion.try_promote(tmp_path, lost_epoch=1, token="t") is None
    _stale_lease(tmp_path)
    assert promotion.try_promote(tmp_path, lost_epoch=1, token="t") is None  # no saved config
    failover.save_config(tmp_path, MasterConfig(nnodes=NodeRange(min=1, max=1)))
    failover.claim(tmp_path, 2)  # another candidate won the claim
    assert promotion.try_promote(tmp_path, lost_epoch=1, token="t") is None
    assert failover.newest_epoch(tmp_path) == 2


def test_the_promoted_agent_serves_the_job_from_the_journal(tmp_path: Path) -> None:
    failover.claim(tmp_path, 1)
    _master_json(tmp_path, 1)
    _stale_lease(tmp_path)
    failover.save_config(tmp_path, MasterConfig(nnodes=NodeRange(min=2, max=2), max_restarts=5))
    Journal(tmp_path / "journal.jsonl").append(round=3, restart_count=2)
    thread = promotion.try_promote(tmp_path, lost_epoch=1, token="t")
    assert thread is not None
    try:
        info = json.loads((tmp_path / "master.json").read_text())
        assert info["epoch"] == 2 and info["embedded"] is True
        socket.create_connection(("127.0.0.1", info["port"]), timeout=5).close()
        job = thread.server.master.job
        assert (job.round, job.restart_count, job.config.max_restarts) == (3, 2, 5)
        lease = failover.read_lease(tmp_path)
        assert lease is not None and lease.epoch == 2
    finally:
        thread.stop("test over")
        thread.join(10)
