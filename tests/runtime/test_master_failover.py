"""The master is no single point of failure (issue 14) on the real local Slurm: a SIGKILLed
master process is started again by the job script and adopts the running round (no worker
restarts); when the master's node dies, an agent takes over and the job pays one re-rendezvous.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from pathlib import Path

import pytest
from runtime_helpers import TRAIN, events, named, sbatch, wait_job, wait_training

from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm
FLASH = TRAIN.parent / "train_flash_ckpt.py"


def _args(work: Path, *, nnodes: str, steps: int) -> list[str]:
    (work / "ckpt").mkdir(exist_ok=True)
    return [
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--max-restarts=0",  # neither fault may spend a restart
        str(TRAIN),
        f"--steps={steps}",
        f"--ckpt-dir={work / 'ckpt'}",
        "--ckpt-every=5",
        "--step-time=0.1",
        f"--result={work / 'result.json'}",
        f"--timing-log={work / 'timing.log'}",
    ]


def _flash_args(work: Path, *, steps: int) -> list[str]:
    return [
        "--nnodes=3",
        "--nproc-per-node=1",
        "--max-restarts=0",
        str(FLASH),
        f"--steps={steps}",
        f"--ckpt-dir={work / 'ckpt'}",
        "--save-every=2",
        "--persist-every=10",
        "--step-time=0.1",
        f"--result={work / 'result.json'}",
        f"--timing-log={work / 'timing.log'}",
    ]


def _wait_steps(work: Path, step: int) -> None:
    log = work / "timing.log"
    wait_for(
        lambda: log.exists() and any(s >= step for _, s in _steps(work)),
        timeout_s=120,
        what=f"training to reach step {step}",
    )


def _master_info(job_dir: Path) -> dict:
    return json.loads((job_dir / "master.json").read_text())


def _finish(work: Path, job: str) -> tuple[list[dict], str]:
    fields = wait_job(job, timeout_s=300)
    out = (work / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-5000:]
    return events(work / ".dlrover-hpc" / job), out


def _steps(work: Path) -> list[tuple[float, int]]:
    rows = [line.split() for line in (work / "timing.log").read_text().splitlines()]
    return [(float(r[0]), int(r[1])) for r in rows if len(r) >= 2]


def test_killed_master_is_restarted_and_adopts_the_running_round(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    job = sbatch(shared_tmp, 3, *_flash_args(shared_tmp, steps=150), extra=("-w", "node[1-3]"))
    job_dir = shared_tmp / ".dlrover-hpc" / job
    _wait_steps(shared_tmp, 10)
    first = _master_info(job_dir)
    os.kill(int(first["pid"]), signal.SIGKILL)
    killed_at = time.time()
    wait_for(
        lambda: _master_info(job_dir)["epoch"] > first["epoch"],
        timeout_s=30,
        what="the job script to start the master again",
    )
    evs, out = _finish(shared_tmp, job)

    [recovered] = named(evs, "master_recovered")
    assert recovered["adopted"] == ["node1", "node2", "node3"], (recovered, out[-4000:])
    assert recovered["rejoined"] == recovered["lost"] == []
    assert recovered["downtime_s"] <= 10.0, recovered
    assert "restarting it on node1" in out
    # The workers trained through the master's absence: one round, no restart, no failure.
    assert len(named(evs, "rendezvous_complete")) == 1, out[-4000:]
    assert not named(evs, "workers_restarted") and not named(evs, "worker_failed")
    assert len(named(evs, "workers_started")) == 3
    assert named(evs, "job_finished")[-1]["restart_count"] == 0
    steps = _steps(shared_tmp)
    after = [t for t, _ in steps if t > killed_at]
    assert after and after[0] - killed_at < 10.0, "training resumed late"
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(steps)]
    assert max(gaps) < 10.0, f"training stalled {max(gaps):.1f} s"
    print(
        f"master SIGKILL: downtime_s {recovered['downtime_s']}, longest step gap "
        f"{max(gaps):.2f} s, first step {after[0] - killed_at:.2f} s after the kill"
    )
    # Checkpoints went on committing under the new master, up to the last step.
    result = json.loads((shared_tmp / "result.json").read_text())
    assert result["final_step"] == 150 and result["committed"] is True, result
    persisted = [e for e in named(evs, "checkpoint_persisted") if e["committed"]]
    assert any(e["time"] > recovered["time"] for e in persisted), "no commit after recovery"


def test_master_node_crash_an_agent_takes_over(local_slurm: LocalSlurm, shared_tmp: Path) -> None:
    job = sbatch(
        shared_tmp,
        3,
        *_args(shared_tmp, nnodes="2:3", steps=150),
        extra=("-w", "node[1-3]"),
        master_opts="--replacement-sbatch=off",
        env={"DLROVER_HPC_MASTER_NODE": "node2"},
    )
    job_dir = shared_tmp / ".dlrover-hpc" / job
    wait_training(shared_tmp, job, 10)
    assert _master_info(job_dir)["host"] == "node2"
    crashed_at = time.time()
    local_slurm.kill_node("node2")  # the master, node2's agent and its worker
    try:
        evs, out = _finish(shared_tmp, job)
    finally:
        local_slurm.restart_node("node2")

    info = _master_info(job_dir)
    assert info["embedded"] and info["epoch"] == 2 and info["host"] in ("node1", "node3"), info
    [recovered] = named(evs, "master_recovered")
    # node1 and node3 lost their peer on node2 before the new master was up: back, not training
    assert recovered["lost"] == ["node2"], (recovered, out[-4000:])
    assert sorted(recovered["adopted"] + recovered["rejoined"]) == ["node1", "node3"]
    rounds = named(evs, "rendezvous_complete")
    after = [r for r in rounds if r["time"] > crashed_at]
    assert len(after) == 1, f"one re-rendezvous, got {len(after)}: {out[-4000:]}"
    assert sorted(after[0]["nodes"]) == ["node1", "node3"]
    assert named(evs, "job_finished")[-1]["restart_count"] == 0
    assert "an agent takes over as master" in out
    result = json.loads((shared_tmp / "result.json").read_text())
    assert result["final_step"] == 150 and result["group_world_size"] == 2
    resumed = next(t for t, _ in _steps(shared_tmp) if t > after[0]["time"])
    print(f"master node crash: training resumed {resumed - crashed_at:.1f} s after the crash")
