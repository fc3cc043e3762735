"""Self-healing capacity on the real local Slurm (issue 12): a dead agent is started again in
the allocation, a node whose link comes back is re-admitted, and neither spends a restart."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from harness.chaos import agents_on
from runtime_helpers import TRAIN, events, named, sbatch, wait_job, wait_training

from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm


def _args(work: Path, steps: int) -> list[str]:
    (work / "ckpt").mkdir(exist_ok=True)
    return [
        "--nnodes=2:3",
        "--nproc-per-node=1",
        "--max-restarts=0",  # a membership change must never spend one
        str(TRAIN),
        f"--steps={steps}",
        f"--ckpt-dir={work / 'ckpt'}",
        "--ckpt-every=5",
        "--step-time=0.1",
        f"--result={work / 'result.json'}",
    ]


def _finish(work: Path, job: str) -> tuple[list[dict], str]:
    fields = wait_job(job, timeout_s=240)
    out = (work / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    return events(work / ".dlrover-hpc" / job), out


def test_killed_agent_is_relaunched_in_the_allocation(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    job = sbatch(
        shared_tmp,
        3,
        # 300 steps: the relaunched agent must join before the training ends (with 120 the
        # job once ended first, cc30)
        *_args(shared_tmp, steps=300),
        extra=("-w", "node[1-3]"),
        master_opts="--replacement-sbatch=off",  # only a relaunch can bring node3 back
    )
    wait_training(shared_tmp, job, 8)
    [agent] = agents_on(local_slurm, "node3")
    os.kill(agent.pid, signal.SIGKILL)
    killed_at = time.time()
    evs, out = _finish(shared_tmp, job)
    [lost] = named(evs, "node_lost")
    assert lost["node"] == "node3" and lost["reason"] == "connection closed", lost
    [relaunched] = named(evs, "node_relaunched")
    assert relaunched["node"] == "node3" and relaunched["attempt"] == 1
    assert relaunched["time"] - killed_at < 15, "relaunched late"
    admitted = named(evs, "node_admitted")
    assert [e["node"] for e in admitted] == ["node3"], out[-3000:]
    assert sorted(named(evs, "rendezvous_complete")[-1]["nodes"]) == ["node1", "node2", "node3"]
    assert named(evs, "job_finished")[-1]["restart_count"] == 0
    result = json.loads((shared_tmp / "result.json").read_text())
    assert result["final_step"] == 300 and result["group_world_size"] == 3
    relaunch_out = list((shared_tmp / ".dlrover-hpc" / job).glob("relaunch-node3-*.out"))
    assert relaunch_out, "the relaunched agent's output is kept in the job directory"


def test_node_whose_link_comes_back_is_readmitted(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    job = sbatch(
        shared_tmp,
        3,
        *_args(shared_tmp, steps=150),
        extra=("-w", "node[1-3]"),
        master_opts="--replacement-sbatch=off",
    )
    wait_training(shared_tmp, job, 8)
    [agent] = agents_on(local_slurm, "node3")
    local_slurm.cut_link("node3")
    try:
        wait_for(
            lambda: named(events(shared_tmp / ".dlrover-hpc" / job), "node_lost"),
            timeout_s=15,
            what="node3 to be seen lost",
        )
    finally:
        local_slurm.heal_link("node3")
    wait_for(
        lambda: named(events(shared_tmp / ".dlrover-hpc" / job), "node_readmitted"),
        timeout_s=30,
        what="node3 to be re-admitted",
    )
    assert agent.is_running(), "the same agent reconnected: it did not exit"
    evs, out = _finish(shared_tmp, job)
    [lost] = named(evs, "node_lost")
    assert lost["node"] == "node3" and lost["reason"] == "link timed out", lost
    assert [e["node"] for e in named(evs, "node_readmitted")] == ["node3"], out[-3000:]
    assert named(evs, "node_relaunched") == []  # its agent was alive: no second one
    assert sorted(named(evs, "rendezvous_complete")[-1]["nodes"]) == ["node1", "node2", "node3"]
    assert named(evs, "job_finished")[-1]["restart_count"] == 0
    result = json.loads((shared_tmp / "result.json").read_text())
    assert result["final_step"] == 150 and result["group_world_size"] == 3


def test_below_min_resumes_within_60_s_without_a_requeue(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    """Issue 12 item 4: a 2:2 job loses a node (below MIN) while idle nodes exist: a
    replacement job joins over TCP and training resumes within 60 s, no requeue hold."""
    args = _args(shared_tmp, steps=120)
    args[0] = "--nnodes=2:2"
    job = sbatch(shared_tmp, 2, *args, extra=("-w", "node[1-2]"))
    wait_training(shared_tmp, job, 8)
    try:
        local_slurm.kill_node("node2")
        evs, out = _finish(shared_tmp, job)
    finally:
        local_slurm.restart_node("node2")
    [lost] = named(evs, "node_lost")
    assert lost["node"] == "node2"
    assert named(evs, "job_requeued") == [], out[-3000:]
    [requested] = named(evs, "replacement_requested")
    resumed = [e for e in named(evs, "rendezvous_complete") if e["time"] > lost["time"]]
    assert resumed and resumed[0]["time"] - lost["time"] < 60, (lost, resumed)
    assert len(resumed[0]["nodes"]) == 2 and "node2" not in resumed[0]["nodes"]
    assert named(evs, "job_finished")[-1]["restart_count"] == 0
    assert json.loads((shared_tmp / "result.json").read_text())["final_step"] == 120
    wait_job(requested["job"], timeout_s=60)
