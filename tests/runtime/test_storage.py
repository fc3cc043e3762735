"""Checkpoint storage that fills up under a real job (dlrover-run --standalone, real tmpfs)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime_helpers import BIN, events, named

#: Every checkpoint kept (the default) fills the 8 MiB file system after about four.
FILLING = r"""
import sys, time
import torch, torch.distributed as dist
from dlrover_hpc.checkpoint import DdpCheckpointer, StorageType

ckpt_dir, keep_last = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
state = {"w": torch.zeros(384 << 10)}  # 1.5 MiB
ckpt = DdpCheckpointer(ckpt_dir, keep_last=keep_last or None)
for step in range(1, 41):
    state["w"].fill_(step)
    if step % 5 == 0:
        ckpt.save_checkpoint(step, state, storage_type=StorageType.DISK)
        ckpt.wait_latest_checkpoint(30)
    time.sleep(0.05)
ckpt.close()
"""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], check=True)
    yield disk
    with contextlib.suppress(subprocess.CalledProcessError):
        subprocess.run(["umount", str(disk)], check=True)


def _job(tmp_path: Path, disk: Path, name: str, keep_last: int) -> tuple[int, str, list[dict]]:
    script = tmp_path / "filling.py"
    script.write_text(FILLING)
    ckpt_dir = disk / name
    job_dir = tmp_path / f"job-{name}"
    proc = subprocess.run(
        [
            str(BIN / "dlrover-run"),
            "--standalone",
            "--nproc-per-node=1",
            f"--job-dir={job_dir}",
            f"--rdzv-id=storage-{name}",
            str(script),
            str(ckpt_dir),
            str(keep_last),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return proc.returncode, proc.stdout + proc.stderr, events(job_dir)


def test_a_job_whose_newest_step_is_not_on_storage_says_so(
    tmp_path: Path, small_disk: Path
) -> None:
    """Issue 28: every checkpoint kept fills the disk; the job used to end 'all workers
    succeeded', exit 0, with an old step the newest on storage. Now: a warning while room
    runs out, naming the retention options, and a failed job naming the durable step."""
    rc, out, evs = _job(tmp_path, small_disk, "all", keep_last=0)
    assert rc == 1, out[-3000:]
    [finished] = named(evs, "job_finished")
    failed = named(evs, "checkpoint_persist_failed")
    assert failed, out[-3000:]
    assert finished["exit_code"] == 1 and finished["checkpoint_step"] == 40, finished
    durable = finished["durable_step"]
    assert 5 <= durable < 40 and durable % 5 == 0, finished
    assert f"the newest committed in {small_disk / 'all'} is step {durable}" in finished["reason"]
    assert "not on storage" in finished["reason"] and "No space left" in finished["reason"]
    assert (small_disk / "all" / "dlrover_latest.txt").read_text().strip() == str(durable)
    [low] = named(evs, "checkpoint_storage_low")
    assert low["time"] < failed[0]["time"] and low["step"] <= durable, (low, failed[0])
    assert "keep_last=N" in low["fix"] and "deletion_strategy" in low["fix"], low
    assert low["free_bytes"] < 2 * low["checkpoint_bytes"], low
    assert "is not on storage" in out  # the agent's log says it too

    # The same job keeping two checkpoints fits: no warning, the last step durable, exit 0.
    shutil.rmtree(small_disk / "all")
    rc, out, evs = _job(tmp_path, small_disk, "two", keep_last=2)
    assert rc == 0, out[-3000:]
    [finished] = named(evs, "job_finished")
    assert finished["checkpoint_step"] == finished["durable_step"] == 40, finished
    assert not named(evs, "checkpoint_storage_low") and not named(evs, "checkpoint_persist_failed")


def test_a_job_whose_shared_memory_is_too_small_still_persists_every_disk_save(
    tmp_path: Path,
) -> None:
    """Issue 28, item 2, as a container with a small --shm-size: the job runs in a mount
    namespace of its own whose /dev/shm holds one 1.5 MiB buffer, not two. Every DISK save
    after the first spills through a disk file and is persisted; nothing fails or stops."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a mount namespace with a small /dev/shm")
    script = tmp_path / "filling.py"
    script.write_text(FILLING)
    job_dir, ckpt_dir, spill = tmp_path / "job", tmp_path / "ckpt", tmp_path / "spill"
    spill.mkdir()
    run = " ".join(
        [
            str(BIN / "dlrover-run"),
            "--standalone",
            "--nproc-per-node=1",
            f"--job-dir={job_dir}",
            "--rdzv-id=small-shm",
            str(script),
            str(ckpt_dir),
            "0",
        ]
    )
    proc = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation=private",
            "sh",
            "-c",
            f"mount -t tmpfs -o size=3m tmpfs /dev/shm && exec {run}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "DLROVER_HPC_SPILL_DIR": str(spill)},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    evs = events(job_dir)
    [finished] = named(evs, "job_finished")
    assert finished["checkpoint_step"] == finished["durable_step"] == 40, finished
    saved = {e["step"]: e for e in named(evs, "checkpoint_saved")}
    assert sorted(saved) == list(range(5, 41, 5)), sorted(saved)
    assert "spilled" not in saved[5]  # the first buffer fits
    assert all("cannot reserve" in saved[s]["spilled"] for s in range(10, 41, 5)), saved
    assert not named(evs, "checkpoint_save_failed") and not named(evs, "checkpoint_persist_failed")
    assert "checkpoint spilled step=10" in out and "--shm-size" in out
    assert os.listdir(spill) == []
    assert (ckpt_dir / "dlrover_latest.txt").read_text().strip() == "40"
