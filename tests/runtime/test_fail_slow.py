"""Fail-slow on the real local Slurm (issues 25 and 50): a 3-node job trains with the default
flags while one node's link is throttled (tbf: this kernel has no netem), then, healed, another
node's training process runs a quarter of the time.  Every rank slows in lockstep under the
slow link, so no rank's compute stands out; the kernel's round trips of the node's TCP
connections (read by its agent with ``ss -tin``) do, and the master reports it as a straggler
(cause ``link``, measured on ``tcp``).  The slow node's compute per step stands out, counted
in steps (cause ``compute``).  Each is found well within 30 s (``benchmarks/fail_slow.py``
measures the seconds: 5-7 s)."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest
from harness.chaos import throttle, training_pids
from runtime_helpers import events, named, sbatch, timing_log, wait_job

from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]


def _found(job_dir: Path, node: str, since: float) -> list[dict]:
    return [
        e
        for e in named(events(job_dir), "straggler_detected")
        if e["node"] == node and e["time"] >= since
    ]


def test_a_throttled_link_and_then_a_slow_node_are_each_found_within_30_s(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    (shared_tmp / "ckpt").mkdir()
    job = sbatch(
        shared_tmp,
        3,
        "--nnodes=3",
        "--nproc-per-node=1",
        str(REPO / "examples" / "train_flash_ckpt.py"),
        "--steps=100000",
        "--step-time=0.1",
        f"--ckpt-dir={shared_tmp / 'ckpt'}",
        "--save-every=5",
        "--persist-every=50",
        f"--timing-log={shared_tmp / 'timing.log'}",
        extra=("-w", "node[1-3]"),
    )
    job_dir = shared_tmp / ".dlrover-hpc" / job
    stop = threading.Event()
    try:
        wait_for(lambda: len(timing_log(shared_tmp)) >= 60, timeout_s=180, what="60 steps")
        local_slurm.slow_link("node3", rate="256kbit")  # the soak's: steps 3-4x longer
        slowed_at = time.time()
        try:
            [link] = wait_for(
                lambda: _found(job_dir, "node3", slowed_at), timeout_s=60, what="a slow link"
            )
        finally:
            local_slurm.unslow_link("node3")
        print(f"slow link found {link['time'] - slowed_at:.1f} s after throttling: {link}")
        assert (link["cause"], link["measured"]) == ("link", "tcp"), link
        assert link["rtt_s"] >= 2.5 * link["peers_rtt_s"], link
        assert link["time"] - slowed_at <= 30.0, link

        time.sleep(5)  # the link's queue drains
        [pid] = training_pids(local_slurm, job, "node2")[:1]
        thread = threading.Thread(target=throttle, args=(pid, lambda: None, stop), daemon=True)
        thread.start()
        throttled_at = time.time()
        [slow] = wait_for(
            lambda: _found(job_dir, "node2", throttled_at), timeout_s=60, what="a slow node"
        )
        print(f"slow node found {slow['time'] - throttled_at:.1f} s after throttling: {slow}")
        assert slow["cause"] == "compute" and slow["ratio"] >= 2.0, slow
        assert slow["slow_steps"] >= 8 and slow["action"] == "reported", slow
        assert slow["time"] - throttled_at <= 30.0, slow
    finally:
        stop.set()
        local_slurm.unslow_link("node3")
        subprocess.run(["scancel", job], check=False, timeout=30)
        wait_job(job, timeout_s=120)
    assert not named(events(job_dir), "hang_detected")
