"""A short chaos run on the local Slurm (issue 12 item 9; ``benchmarks/soak.py`` is the long
one): a seeded stream of an agent kill, a cut link, a worker kill and a node crash against a
job with a hot spare.  The job must finish with no step lost beyond the newest memory
checkpoint, no stall over 60 s, and membership changes restored from memory or a peer."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.chaos import FaultKind
from harness.soak import run_soak

from dlrover_hpc.localslurm import LocalSlurm

pytestmark = pytest.mark.slurm

KINDS = (FaultKind.AGENT_KILL, FaultKind.LINK_CUT, FaultKind.WORKER_KILL, FaultKind.NODE_CRASH)


# About 5 minutes alone; side by side with other tests it ran past pytest's 300 s default.
@pytest.mark.timeout(900)
def test_job_under_a_fault_stream_loses_nothing(local_slurm: LocalSlurm, shared_tmp: Path) -> None:
    report = run_soak(
        local_slurm,
        shared_tmp,
        nodes=4,
        nnodes="2:3",
        duration_s=85,
        every_s=20,
        seed=7,
        step_time=0.1,
        kinds=KINDS,
        heal_s={FaultKind.LINK_CUT: 10.0, FaultKind.NODE_CRASH: 15.0},
    )
    context = f"chaos report: {report}"
    assert report["job_state"] == "COMPLETED" and report["completed"], context
    assert sorted(f["kind"] for f in report["faults"]) == sorted(KINDS), context
    assert all(f["node"] for f in report["faults"]), context  # each fault hit a node
    assert report["lost_steps"] == 0, context
    assert report["max_stall_s"] < 60, context
    assert report["restarts"] >= 3, context  # the faults were felt
    assert report["restores"].get("storage", 0) == 0, context
    assert report["restores"].get("memory", 0) > 0, context
