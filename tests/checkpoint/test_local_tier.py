"""The node-local checkpoint tier (--local-ckpt-dir) on real files: layout, records,
retention, a failing local disk, and restores that read it (source local) or the shared copy."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

from dlrover_hpc import environ
from dlrover_hpc.agent.requeue_memory import stale_tiers
from dlrover_hpc.checkpoint import DdpCheckpointer, RankCheckpointer, StorageType
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.event_sinks import ListEventSink
from dlrover_hpc.checkpoint.saver.local_tier import (
    LocalRecord,
    LocalTier,
    job_tier_exists,
    remove_job_tier,
    tier_root,
)
from dlrover_hpc.checkpoint.testing import check_filled, filled_state

pytestmark = pytest.mark.timeout(120)


def _env(job: str, *, rank: int = 0, world: int = 1) -> WorkerEnv:
    return WorkerEnv.from_environ(
        {
            "DLROVER_HPC_JOB_ID": job,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
        }
    )


@pytest.mark.parametrize(
    ("shared_path", "twin"),
    [
        ("/shared/ckpt/checkpoint-4.pt", "checkpoint-4.pt"),
        ("/shared/ckpt/checkpoint-4", "checkpoint-4"),
        ("/shared/ckpt/runs/a/step-4/", "runs/a/step-4"),
        ("/shared/ckpt", None),  # the directory itself is no step
        ("/shared/ckpt-other/checkpoint-4.pt", None),  # beside it, not under it
        ("/elsewhere/checkpoint-4.pt", None),
        ("/shared/ckpt/.dlrover-hpc/commits/step-4.json", None),  # bookkeeping stays shared
    ],
)
def test_local_path_mirrors_the_shared_layout(
    tmp_path: Path, shared_path: str, twin: str | None
) -> None:
    tier = LocalTier(str(tmp_path), shared_root="/shared/ckpt", job="42", node="n1")
    expected = (
        None if twin is None else f"{tier_root(str(tmp_path), '42', 'n1', '/shared/ckpt')}/{twin}"
    )
    assert tier.local_path(shared_path) == expected


@pytest.mark.parametrize(
    ("kind", "parts", "ranks", "rank", "serves"),
    [
        ("ddp", 1, (0,), 0, True),  # DDP's one file
        ("ddp", 1, (0,), 3, True),  # every rank reads rank 0's file
        ("rank", 4, (2, 3), 2, True),  # a rank's own file
        ("rank", 4, (2, 3), 1, False),  # another node's rank
        ("fsdp", 4, (2, 3), 2, False),  # DCP may read every shard
        ("fsdp", 2, (0, 1), 1, True),  # every shard on this node
    ],
)
def test_a_local_record_serves_the_ranks_that_find_all_they_read(
    kind: str, parts: int, ranks: tuple[int, ...], rank: int, serves: bool
) -> None:
    rec = LocalRecord(step=4, token=7, kind=kind, parts=parts, ranks=ranks, path="/s/c", time=0)
    assert rec.serves(rank) is serves


def test_records_merge_ranks_of_one_save_and_retention_keeps_the_newest(tmp_path: Path) -> None:
    tier = LocalTier(str(tmp_path), shared_root="/shared/ckpt", job="42", node="n1")
    common = {"kind": "rank", "parts": 2}
    for step in (2, 4, 6):
        data = Path(tier.local_path(f"/shared/ckpt/checkpoint-{step}") or "")
        data.mkdir(parents=True)
        (data / "rank_00000.pt").write_bytes(b"x")
        tier.add(step=step, token=7, ranks=(0,), path=f"/shared/ckpt/checkpoint-{step}", **common)
    rec = tier.add(step=6, token=7, ranks=(1,), path="/shared/ckpt/checkpoint-6", **common)
    assert rec.ranks == (0, 1)
    # a newer save of the same step (another token) replaces what the older one held
    assert tier.add(
        step=6, token=8, ranks=(1,), path="/shared/ckpt/checkpoint-6", **common
    ).ranks == (1,)
    assert tier.holds(step=6, token=8, rank=1) is not None
    assert tier.holds(step=6, token=7, rank=1) is None  # not that save
    assert tier.holds(step=6, token=8, rank=0) is None  # not that rank's part
    assert tier.retain(2) == [2]
    assert tier.steps() == [6, 4]
    assert not Path(tier.root, "checkpoint-2").exists()
    assert Path(tier.root, "checkpoint-4", "rank_00000.pt").exists()
    assert job_tier_exists(str(tmp_path), "42", "n1")
    assert remove_job_tier(str(tmp_path), "42", "n1")
    assert not job_tier_exists(str(tmp_path), "42", "n1") and tmp_path.is_dir()


def test_a_persisted_step_goes_to_the_local_tier_first_and_a_restore_reads_it_there(
    tmp_path: Path, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared, local = tmp_path / "shared", tmp_path / "local"
    monkeypatch.setenv(environ.LOCAL_CKPT_DIR, str(local))
    ckpt = DdpCheckpointer(str(shared), env=_env(job), keep_last=2)
    try:
        for step in (2, 4, 6):
            assert ckpt.save_checkpoint(step, filled_state(step), storage_type=StorageType.DISK)
            assert ckpt.wait_latest_checkpoint(30)
    finally:
        ckpt.close(remove_segments=True)
    root = Path(tier_root(str(local), job, _env(job).node_name, str(shared)))
    # the same layout as the shared directory, keep_last=2 steps of it
    assert sorted(p.name for p in root.glob("*.pt")) == ["checkpoint-4.pt", "checkpoint-6.pt"]
    assert (root / "checkpoint-6.pt").read_bytes() == (shared / "checkpoint-6.pt").read_bytes()
    assert (shared / "dlrover_latest.txt").read_text() == "6\n"  # the commit is the shared one

    # The shared copy of step 6 is made unreadable: the restore never opens it.
    (shared / "checkpoint-6.pt").write_bytes(b"not a checkpoint")
    again = DdpCheckpointer(str(shared), env=_env(job), keep_last=2)
    try:
        check_filled(again.load_checkpoint(), 6)
        assert again.last_restored == (6, "local")
    finally:
        again.close(remove_segments=True)


def test_a_restore_reads_the_shared_copy_when_the_local_tier_lacks_the_step(
    tmp_path: Path, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared, local = tmp_path / "shared", tmp_path / "local"
    monkeypatch.setenv(environ.LOCAL_CKPT_DIR, str(local))
    events = ListEventSink()
    ckpt = DdpCheckpointer(str(shared), env=_env(job), events=events)
    try:
        assert ckpt.save_checkpoint(3, filled_state(3), storage_type=StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)
    finally:
        ckpt.close(remove_segments=True)
    root = Path(tier_root(str(local), job, _env(job).node_name, str(shared)))
    (root / "checkpoint-3.pt").unlink()  # record kept, data gone: a torn local tier
    again = DdpCheckpointer(str(shared), env=_env(job), events=events)
    try:
        check_filled(again.load_checkpoint(), 3)
        assert again.last_restored == (3, "storage")
    finally:
        again.close(remove_segments=True)
    remove_job_tier(
        str(local), job, _env(job).node_name
    )  # a whole node's tier gone (a new node): shared again
    third = DdpCheckpointer(str(shared), env=_env(job), events=events)
    try:
        check_filled(third.load_checkpoint(), 3)
        assert third.last_restored == (3, "storage")
        restored = events.named("checkpoint_restored")
        assert [e["source"] for e in restored] == ["storage", "storage"]
    finally:
        third.close(remove_segments=True)


def test_each_rank_reads_its_own_part_locally(
    tmp_path: Path, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank checkpointer's part (one file per rank) is served by the local tier."""
    shared, local = tmp_path / "shared", tmp_path / "local"
    monkeypatch.setenv(environ.LOCAL_CKPT_DIR, str(local))
    ckpt = RankCheckpointer(str(shared), env=_env(job))
    try:
        assert ckpt.save_checkpoint(5, filled_state(5), storage_type=StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)
    finally:
        ckpt.close(remove_segments=True)
    (shared / "checkpoint-5" / "rank_00000.pt").unlink()
    again = RankCheckpointer(str(shared), env=_env(job))
    try:
        check_filled(again.load_checkpoint(), 5)
        assert again.last_restored == (5, "local")
    finally:
        again.close(remove_segments=True)


def test_a_full_local_disk_falls_back_to_the_shared_directory_and_loses_no_step(
    tmp_path: Path, job: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    shared, local = tmp_path / "shared", tmp_path / "local"
    local.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(local)], check=True)
    monkeypatch.setenv(environ.LOCAL_CKPT_DIR, str(local))
    events = ListEventSink()
    try:
        ckpt = DdpCheckpointer(str(shared), env=_env(job), events=events)
        try:
            assert ckpt.save_checkpoint(1, filled_state(1), storage_type=StorageType.DISK)
            assert ckpt.wait_latest_checkpoint(30)
            for step in (2, 3):  # 1 MiB of state: no room on the local disk
                big = filled_state(step, numel=1 << 18)
                assert ckpt.save_checkpoint(step, big, storage_type=StorageType.DISK)
                assert ckpt.wait_latest_checkpoint(30)  # committed on the shared tier
        finally:
            ckpt.close(remove_segments=True)
        assert (shared / "dlrover_latest.txt").read_text() == "3\n"
        failed = events.named("checkpoint_local_tier_failed")
        assert [e["step"] for e in failed] == [2]  # once until the local disk works again
        assert "local_tier_failed step=3" in caplog.text  # every step is logged
        assert "straight to the shared checkpoint directory" in caplog.text
        root = Path(tier_root(str(local), job, _env(job).node_name, str(shared)))
        assert not [p for p in root.rglob("*") if "tmp" in p.name or "-2" in p.name]
        again = DdpCheckpointer(str(shared), env=_env(job))
        try:
            check_filled(again.load_checkpoint(), 3)
            assert again.last_restored == (3, "storage")
        finally:
            again.close(remove_segments=True)
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            subprocess.run(["umount", str(local)], check=True)


@pytest.mark.parametrize(
    ("names", "stale"),
    [
        (["alice_12_node1", "alice_13_node2"], ["alice_12_node1"]),  # 13 is still listed
        (["bob_12_node1"], []),  # another user's
        (["alice_local_node1", "alice_x12_node1", "notes.txt"], []),  # no Slurm job id
        (["alice_13_node1"], []),
    ],
)
def test_the_local_tiers_of_jobs_slurm_no_longer_lists_are_stale(
    names: list[str], stale: list[str]
) -> None:
    assert stale_tiers(names, user="alice", live_jobs={"13"}) == stale
