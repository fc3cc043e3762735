"""Shared fixtures: one local 4-node Slurm per session, and a leak check around every test."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrover_hpc.checkpoint.testing import remove_job_segments
from dlrover_hpc.testing import LocalSlurm, LocalSlurmConfig
from dlrover_hpc.testing.leaks import take_snapshot, wait_no_leaks

REPO = Path(__file__).resolve().parent.parent
_slurm: LocalSlurm | None = None


@pytest.fixture(scope="session")
def local_slurm() -> Iterator[LocalSlurm]:
    """A real 4-node Slurm on this machine; brought up once per session (root only)."""
    global _slurm
    if os.geteuid() != 0:
        pytest.skip("the local multi-node Slurm needs root (namespaces, daemons)")
    cluster = LocalSlurm(LocalSlurmConfig(nodes=4))
    was_up = cluster.is_up()
    cluster.up()
    _slurm = cluster
    yield cluster
    _slurm = None
    if not was_up:
        pids = {*cluster.slurmd_pids().values()}
        cluster.down()
        # `down` must leave no daemon, namespace or bridge of ours behind.
        left = [p for p in pids if Path(f"/proc/{p}").exists()]
        netns = (
            [n for n in os.listdir("/run/netns") if n.startswith("dlhpc-")]
            if Path("/run/netns").exists()
            else []
        )
        assert not left and not netns and not Path("/sys/class/net/dlhpc-br0").exists(), (
            f"local-slurm down left behind: pids={left} netns={netns}"
        )


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves child processes, namespaces or /dev/shm entries behind."""
    pids = _slurm.slurmd_pids() if _slurm else {}
    before = take_snapshot(slurmd_pids=pids)
    yield
    if request.node.get_closest_marker("allow_leaks"):
        return
    pids = _slurm.slurmd_pids() if _slurm else {}
    leaked = wait_no_leaks(before, slurmd_pids=pids)
    if leaked:
        pytest.fail("test leaked:\n  " + "\n  ".join(leaked), pytrace=False)


@pytest.fixture
def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every local-Slurm node and an unprivileged user can read and write."""
    path = tmp_path_factory.mktemp("shared")
    for p in [path, *path.parents]:
        if p == Path("/"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o755)
    os.chmod(path, 0o1777)
    return path


def which(name: str) -> str:
    found = shutil.which(name)
    assert found, f"{name} is not on PATH"
    return found


@pytest.fixture
def job() -> Iterator[str]:
    """A unique checkpoint job id; fails the test if it leaves a /dev/shm segment behind."""
    job_id = f"t{uuid.uuid4().hex[:10]}"
    yield job_id
    left = remove_job_segments(job_id)
    assert not left, f"test leaked shared-memory segments: {left}"
