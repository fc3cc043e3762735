"""The master's shard service: its file survives a master restart; the worker's client asks a
real in-process master over TCP."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrover_hpc.config import MasterConfig, NodeRange
from dlrover_hpc.data.client import ShardingClient
from dlrover_hpc.errors import ProtocolError
from dlrover_hpc.master.cluster import NoCluster
from dlrover_hpc.master.datasets import Datasets
from dlrover_hpc.master.thread import MasterThread
from dlrover_hpc.protocol import messages as m


def _req(rank: int, round: int = 1, start: int = 0, size: int = 100) -> m.ShardRequest:
    return m.ShardRequest(
        dataset="d",
        size=size,
        shard_size=10,
        epochs=1,
        round=round,
        rank=rank,
        start=start,
        batch_size=2,
    )


def test_a_restarted_master_goes_on_from_its_file(tmp_path: Path) -> None:
    first = Datasets(tmp_path)
    assert first.request(_req(0), current_round=1) == m.ShardReply(epoch=0, start=0, end=10)
    assert first.request(_req(1), current_round=1) == m.ShardReply(epoch=0, start=10, end=20)
    with (tmp_path / "datasets.jsonl").open("a") as f:
        f.write('{"dataset":"d","hand')  # a crash mid-write: that shard never went out
    again = Datasets(tmp_path)
    assert again.request(_req(0), current_round=1) == m.ShardReply(epoch=0, start=20, end=30)
    # Round 2 resumed at batch 3: each rank kept 6 samples of its first shard.
    assert again.request(_req(0, round=2, start=3), current_round=2).start == 6
    assert again.ledgers["d"].trained() == [(0, 0, 6), (0, 10, 16)]
    with pytest.raises(ValueError, match="round 1, but round 2 runs"):
        again.request(_req(0), current_round=2)
    with pytest.raises(ValueError, match="every rank must describe it the same way"):
        again.request(_req(0, round=2, size=99), current_round=2)
    (tmp_path / "datasets.jsonl").write_text('{"dataset":"d"}\n{"x":1}\n')
    with pytest.raises(ValueError, match=r"datasets.jsonl, line 1"):
        Datasets(tmp_path)


def test_the_client_reads_every_sample_from_a_real_master(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = MasterConfig(host="127.0.0.1", nnodes=NodeRange.parse("1:1"), job_dir=str(tmp_path))
    master = MasterThread(config, token="secret", job_dir=tmp_path, cluster=NoCluster())
    port = master.start()
    try:
        monkeypatch.setenv("DLROVER_HPC_MASTER", f"127.0.0.1:{port}")
        monkeypatch.setenv("DLROVER_HPC_TOKEN", "secret")
        monkeypatch.setenv("DLROVER_HPC_JOB_DIR", str(tmp_path))
        monkeypatch.setenv("DLROVER_HPC_ROUND", "0")  # no rendezvous ran: the master's round
        monkeypatch.setenv("RANK", "0")
        client = ShardingClient("toy", 50, batch_size=4, shard_size=8, num_epochs=2, shuffle=True)
        try:
            got = list(client.indices())
        finally:
            client.close()
        assert sorted(got) == sorted([*range(50), *range(50)])
        assert got[:50] != list(range(50))  # shuffled
        monkeypatch.setenv("DLROVER_HPC_ROUND", "7")
        stale = ShardingClient("toy", 50, batch_size=4)
        try:
            with pytest.raises(ProtocolError, match="round 7, but round 0 runs"):
                stale.fetch_shard()
        finally:
            stale.close()
    finally:
        master.stop("test over")
        master.join(10)
