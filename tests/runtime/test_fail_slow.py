"""A slow link on the real local Slurm (issue 25): one node's link throttled (tbf: this kernel
has no netem) while a 3-node job trains with the default flags.  Every rank slows in lockstep,
so no rank's compute stands out; the node's heartbeats queue behind its link, and the master
reports it as a straggler (cause ``link``) within 60 s, with the round trips as evidence."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from runtime_helpers import TRAIN, events, named, sbatch, wait_job, wait_training

from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm


def test_a_throttled_link_is_reported_as_a_slow_node(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    (shared_tmp / "ckpt").mkdir()
    job = sbatch(
        shared_tmp,
        3,
        "--nnodes=3",
        "--nproc-per-node=1",
        str(TRAIN),
        "--steps=100000",
        "--step-time=0.1",
        f"--ckpt-dir={shared_tmp / 'ckpt'}",
        "--ckpt-every=50",
        extra=("-w", "node[1-3]"),
    )
    job_dir = shared_tmp / ".dlrover-hpc" / job
    wait_training(shared_tmp, job, 20)
    local_slurm.slow_link("node3", rate="32kbit")  # below its gloo traffic (~100 kbit/s)
    slowed_at = time.time()
    try:
        [found] = wait_for(
            lambda: named(events(job_dir), "straggler_detected"),
            timeout_s=120,
            what="straggler_detected",
        )
    finally:
        local_slurm.unslow_link("node3")
        subprocess.run(["scancel", job], check=False, timeout=30)
        wait_job(job, timeout_s=120)
    latency = found["time"] - slowed_at
    print(f"slow link found {latency:.1f} s after throttling: {found}")
    assert found["node"] == "node3" and found["cause"] == "link", found
    assert found["rtt_s"] >= 3 * found["peers_rtt_s"], found
    assert latency <= 60.0, found
    assert not named(events(job_dir), "hang_detected")
