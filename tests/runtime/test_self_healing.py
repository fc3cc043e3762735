"""Self-healing capacity on the real local Slurm (issue 12): a dead agent is started again in
the allocation, a node whose link comes back is re-admitted, and neither spends a restart."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from runtime_helpers import TRAIN, events, named, sbatch, wait_job

from dlrover_hpc.testing import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm

AGENT_MARKS = ("dlrover-run", "dlrover_hpc.cli.run")


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


def _agents_on(local_slurm: LocalSlurm, node: str) -> list[psutil.Process]:
    """dlrover-run processes in the node's namespace (not their workers or the zygote)."""
    found = []
    for pid in local_slurm.netns_pids(node):
        try:
            proc = psutil.Process(pid)
            cmd = " ".join(proc.cmdline())
            parent = " ".join(proc.parent().cmdline()) if proc.parent() else ""
        except psutil.Error:
            continue
        if any(k in cmd for k in AGENT_MARKS) and not any(k in parent for k in AGENT_MARKS):
            found.append(proc)
    return found


def _wait_step(work: Path, job: str, step: int) -> None:
    out = work / f"slurm-{job}.out"
    wait_for(
        lambda: out.exists() and f"step {step} loss" in out.read_text(),
        timeout_s=120,
        what=f"job {job} to reach step {step}",
        interval_s=0.3,
    )


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
        *_args(shared_tmp, steps=120),
        extra=("-w", "node[1-3]"),
        master_opts="--replacement-sbatch=off",  # only a relaunch can bring node3 back
    )
    _wait_step(shared_tmp, job, 8)
    [agent] = _agents_on(local_slurm, "node3")
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
    assert result["final_step"] == 120 and result["group_world_size"] == 3
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
    _wait_step(shared_tmp, job, 8)
    [agent] = _agents_on(local_slurm, "node3")
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
