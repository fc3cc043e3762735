"""Shared fixtures: one local 4-node Slurm per session, and a leak check around every test.

Side by side (``pytest -n N``, as ``make test`` runs): each worker process gets a mount
namespace of its own (private ``/dev/shm`` and ``/run/netns``) and a local Slurm of its own
(cluster N+1: its own name, ports, bridges, subnets, spool and ``SLURM_CONF``), so that the
leak checks and the clusters of two workers never see each other.  Alone (``-n 0``), the
session uses the default cluster 0, as ``dlrover-hpc local-slurm up`` does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.isolation import private_mounts, worker_index
from harness.leaks import take_snapshot, wait_no_leaks
from warm_python import WarmPython

from dlrover_hpc.checkpoint.testing import remove_job_segments
from dlrover_hpc.localslurm import LocalSlurm, LocalSlurmConfig

REPO = Path(__file__).resolve().parent.parent
_slurm: LocalSlurm | None = None


#: Whole jobs and real servers (``make test-fast`` leaves them out with ``-m 'not runtime'``).
RUNTIME = ("tests/runtime/", "tests/ssh/test_launch.py", "tests/testing/test_prometheus.py")


def pytest_configure(config: pytest.Config) -> None:
    # Many tiny ranks share two cores: intra-op threads would only spin against each other.
    # (Inherited by every job the tests start: sbatch exports the environment.)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    index = worker_index()
    if index and os.geteuid() == 0:
        private_mounts()
        os.environ["SLURM_CONF"] = str(LocalSlurmConfig(index=index).slurm_conf)


#: Public training scripts the matrix runs (tests/runtime/test_unchanged_clients.py), vendored
#: as they are: accelerate's test_script.py is not our test.
collect_ignore = ["clients"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The runtime tests first, the longest of them before the others, so that side by side
    the long ones start early and the short ones fill the gaps at the end.  Each test on a
    real Slurm is marked ``slurm``, each whole job or real server ``runtime``."""
    for item in items:
        if "local_slurm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)
        if item.nodeid.startswith(RUNTIME):
            item.add_marker(pytest.mark.runtime)
    items.sort(key=_order)


#: The longest files first (a chaos job of 5 minutes, the time-limit continuation of 4): side
#: by side, the run ends when its longest test ends unless that test starts early.
LONGEST_FIRST = (
    "tests/runtime/test_chaos.py",
    "tests/runtime/test_continuation.py",
    "tests/ssh/test_launch.py",  # each worker that runs one brings up 4 SSH hosts of its own
    "tests/runtime/test_report.py",
    "tests/runtime/test_storage_faults.py",  # a 40 s file-server stall, then four more faults
    "tests/runtime/test_frameworks.py",  # 10 jobs of 2 nodes, side by side
    "tests/runtime/test_dlrover_examples.py",
    "tests/runtime/test_elastic_batch.py",
    "tests/runtime/test_hang.py",
    "tests/runtime/test_unchanged_clients.py",  # public scripts under both launchers
    "tests/runtime/test_sharding.py",
)


def _order(item: pytest.Item) -> int:
    for i, prefix in enumerate(LONGEST_FIRST):
        if item.nodeid.startswith(prefix):
            return i
    return len(LONGEST_FIRST) + (0 if item.nodeid.startswith(RUNTIME) else 1)


@pytest.fixture(scope="session")
def local_slurm() -> Iterator[LocalSlurm]:
    """A real 4-node Slurm on this machine; brought up once per session (root only)."""
    global _slurm
    if os.geteuid() != 0:
        pytest.skip("the local multi-node Slurm needs root (namespaces, daemons)")
    cluster = LocalSlurm(LocalSlurmConfig(nodes=4, index=worker_index()))
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
        prefix = cluster.config.netns("")
        netns = (
            [n for n in os.listdir("/run/netns") if n.startswith(prefix)]
            if Path("/run/netns").exists()
            else []
        )
        bridge = Path(f"/sys/class/net/{cluster.config.bridge}")
        assert not left and not netns and not bridge.exists(), (
            f"local-slurm down left behind: pids={left} netns={netns}"
        )


@pytest.fixture(scope="session")
def warm_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmPython]:
    """``warm_python([script, *args])``: the command line of a torch rank forked from one
    pre-warmed interpreter per test worker (about 2 s of CPU saved per rank).  Session-scoped,
    so it is started before a test's leak snapshot; a rank left running is still a leak."""
    warm = WarmPython.start(
        str(tmp_path_factory.getbasetemp() / "zygote.sock"), {**os.environ, "OMP_NUM_THREADS": "1"}
    )
    yield warm
    warm.close()


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


@pytest.fixture(autouse=True)
def no_jobs_left(request: pytest.FixtureRequest, no_leaks: None) -> Iterator[None]:
    """A test on the local Slurm that fails midway can leave its job running (or pending,
    holding its nodes); the next tests of this worker would then wait for nodes behind it and
    fail too.  Its jobs are cancelled (and waited for) before the leak check runs."""
    yield
    if _slurm is None or "local_slurm" not in request.fixturenames:
        return
    jobs = _queued_jobs()
    if not jobs:
        return
    print(f"cancelling the jobs this test left in the queue: {' '.join(jobs)}")
    subprocess.run(["scancel", *jobs], capture_output=True, timeout=30)
    deadline = time.monotonic() + 90
    while _queued_jobs() and time.monotonic() < deadline:
        time.sleep(0.5)


def _queued_jobs() -> list[str]:
    proc = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30)
    return proc.stdout.split()


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
