"""Checkpoints on a real network file system that fails (issue 49, item 1): every local-Slurm
node mounts the checkpoint directory from a file server in its own network namespace (sshfs
over TCP; NFS where the kernel has a client), and the server stalls, fills, goes read-only,
restarts or loses its link while a 2-node job saves 16 MiB to DISK every 4 steps of 0.1 s.

In each fault training goes on and nothing is lost: no step is trained twice, no gap between
two steps is over 3 s, the step trained once the nodes' mounts answer again after the fault is
committed on the export soon after, and the job's verdict names the newest durable step (its
last).  "Answer again" is the file system client's own recovery, measured apart (a small write
from each node): on a loaded machine sshfs once hung 130 s over a link that had come back.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.fileserver import (
    FileServer,
    FileServerConfig,
    FileServerError,
    NfsServer,
    SshfsServer,
    nfs_available,
)
from harness.storage_faults import MatrixRun, StorageFault, run_matrix
from runtime_helpers import named

from dlrover_hpc.localslurm import LocalSlurm

pytestmark = pytest.mark.slurm

MAX_GAP_S = 3.0  # the bound: training never waits for storage
STALL_S = 40.0
HOLD_S = 6.0  # the other faults: long enough for a few persists to meet them
#: faults after which sshfs can strand the request a persist had in flight (see below)
STRANDING = (StorageFault.RESTART, StorageFault.LINK_CUT)
DURABLE_S = 20.0  # mounts answer again -> the step trained then committed (2 loaded cores)


def _server(kind: str, cluster: LocalSlurm, tmp: Path, shared: Path) -> Iterator[FileServer]:
    config = FileServerConfig(state_dir=tmp / "fileserver", mount_point=shared / "mnt")
    server = (SshfsServer if kind == "sshfs" else NfsServer)(cluster, config)
    server.up()
    try:
        yield server
    finally:
        server.down()


@pytest.fixture
def sshfs(local_slurm: LocalSlurm, tmp_path: Path, shared_tmp: Path) -> Iterator[FileServer]:
    yield from _server("sshfs", local_slurm, tmp_path, shared_tmp)


@pytest.fixture(params=["sshfs", "nfs"])
def fileserver(
    request: pytest.FixtureRequest, local_slurm: LocalSlurm, tmp_path: Path, shared_tmp: Path
) -> Iterator[FileServer]:
    if request.param == "nfs" and not nfs_available():
        pytest.skip("this kernel has no NFS client (no nfs in /proc/filesystems)")
    yield from _server(request.param, local_slurm, tmp_path, shared_tmp)


def _assert_nothing_lost(run: MatrixRun) -> None:
    tail = run.output[-3000:]
    assert run.state == "COMPLETED", tail
    steps = [s for _, s in run.timing]
    assert steps == list(range(1, run.last_step + 1)), "a step trained twice or skipped"
    assert len(run.windows) == len(run.outcomes) and run.outcomes, run.windows
    for o in run.outcomes:
        assert o.steps_lost == 0, o
        assert o.longest_gap_s <= MAX_GAP_S, (o, tail)
        if o.durable_after_s is None and o.kind in STRANDING:
            # sshfs strands a request that was in flight when its connection died: new
            # requests go through (the mounts answered), that one stays unanswered for up to
            # minutes (130 s seen) and the saver's persist thread waits on it.  The saver must
            # report it; the job's last step is still durable at the end (below).  A saver
            # that abandons such a persist and retries on a fresh open is not built yet.
            assert o.stalled_events >= 1, o
            continue
        assert o.durable_after_s is not None, o
        # A persist request that storage answers only after the mounts answer (a stranded
        # one, or any write that stalls past the fault): the bound counts from then, when
        # storage answers the saver's persist thread again (a LINK_CUT once took 20.2 s from
        # the mounts answering, 8 stall events; a FULL fault 20.5 s, its stall ending at
        # 20.1 s: CI's loaded 2 cores).  With no stall reported past the mounts' answer, from
        # the answer.
        assert o.durable_after_s - (o.stall_ended_after_s or 0.0) <= DURABLE_S, o
    # The job's last step is durable, and its verdict says so.
    assert run.export_step == run.last_step, (run.export_step, run.last_step)
    finished = run.finished
    assert finished.get("exit_code") == 0, (finished, tail)
    assert finished["checkpoint_step"] == finished["durable_step"] == run.last_step, finished
    assert not named(run.events, "checkpoint_save_failed"), named(
        run.events, "checkpoint_save_failed"
    )


def test_a_file_server_that_stalls_for_40_s_does_not_stall_training(
    sshfs: FileServer, shared_tmp: Path
) -> None:
    """The issue's "done when": the server SIGSTOPped for 40 s mid-training.  The step rate
    holds (within 0.7x of before), persisting resumes with the newest step once it answers,
    ``persist_stalled`` marks the stall, and the job ends with its last step durable."""
    run = run_matrix(sshfs, shared_tmp, [StorageFault.STALL], hold_s=lambda _: STALL_S)
    [stall] = run.outcomes
    print(f"stall: {stall.as_dict()}")
    assert stall.rate_ratio >= 0.7, stall
    _assert_nothing_lost(run)
    stalled = named(run.events, "persist_stalled")
    assert stall.stalled_events >= 1, "no persist_stalled event marked the stall"
    assert any(e.get("seconds", 0) >= STALL_S / 2 for e in stalled), stalled


def test_full_read_only_restarted_and_cut_off_storage_lose_nothing(
    fileserver: FileServer, shared_tmp: Path
) -> None:
    """The fault matrix but the stall, one fault after the other in one job: the export full,
    read-only, its server killed and started again, its link cut.  Persists fail (or wait)
    while each lasts; training does not notice, and the newest step is committed once it
    clears."""
    kinds = [
        StorageFault.FULL,
        StorageFault.READ_ONLY,
        StorageFault.RESTART,
        StorageFault.LINK_CUT,
    ]
    run = run_matrix(fileserver, shared_tmp, kinds, hold_s=lambda _: HOLD_S, refused_by=kinds[:3])
    for o in run.outcomes:
        print(f"{o.kind}: {o.as_dict()}")
    assert [w.kind for w in run.windows] == kinds
    _assert_nothing_lost(run)
    # The faults were real: storage refused persists while full, read-only or without server.
    failed = named(run.events, "checkpoint_persist_failed")
    for w in run.windows[:3]:
        assert any(w.begin <= e["time"] <= w.end + 2 for e in failed), (w.kind, failed)


def test_the_file_server_is_a_real_network_file_system(
    sshfs: FileServer, local_slurm: LocalSlurm
) -> None:
    """Each node is a client of its own (its own TCP connection to the server's address);
    what one node writes, the other reads and the server stores; a stopped server makes a
    client wait, not fail; a killed one fails it until it is back."""
    mnt = sshfs.mount_point
    for node in ("node1", "node2"):
        assert sshfs.node_mounted(node)
        conns = sshfs.node_exec(node, ["ss", "-Htn", "state", "established"])
        assert f"{sshfs.address}:{sshfs.config.port}" in conns, (node, conns)
    sshfs.node_exec("node1", ["sh", "-c", f"echo from-node1 > {mnt}/probe"])
    assert sshfs.node_exec("node2", ["cat", f"{mnt}/probe"]).strip() == "from-node1"
    assert (sshfs.export / "probe").read_text().strip() == "from-node1"
    assert not (mnt / "probe").exists()  # the test's own view: the empty mount point
    sshfs.stop()
    try:
        argv = [*local_slurm.node_exec_argv("node2"), "cat", f"{mnt}/probe"]
        reader = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        time.sleep(2.0)
        assert reader.poll() is None, "a read from a stopped server did not wait"
    finally:
        sshfs.cont()
    assert reader.communicate(timeout=30)[0].strip() == "from-node1"
    sshfs.kill()
    with pytest.raises(FileServerError, match="Input/output error"):
        sshfs.node_exec("node2", ["cat", f"{mnt}/probe"])
    sshfs.restart()
    assert sshfs.node_exec("node2", ["cat", f"{mnt}/probe"]).strip() == "from-node1"
