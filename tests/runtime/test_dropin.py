"""An unchanged torchrun job script, with only ``torchrun`` -> ``dlrover-run`` (issue 14).

The script is the shape of the PyTorch DDP tutorial's multi-node sbatch script: it finds the
head node's address with ``srun hostname --ip-address`` and passes it as the c10d endpoint.
No job master step, no token, no job directory: the agent on the endpoint's host embeds the
master and the others connect to it."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import pytest
from runtime_helpers import TRAIN, events, named, run_env, wait_job

from dlrover_hpc.localslurm import LocalSlurm

pytestmark = pytest.mark.slurm

SCRIPT = """#!/bin/bash
#SBATCH --job-name=multinode-example
#SBATCH --nodes=3
#SBATCH --ntasks=3
#SBATCH --cpus-per-task=1

nodes=( $( scontrol show hostnames $SLURM_JOB_NODELIST ) )
nodes_array=($nodes)
head_node=${{nodes_array[0]}}
head_node_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address)

echo Node IP: $head_node_ip
export LOGLEVEL=INFO

srun dlrover-run \\
--nnodes 3 \\
--nproc_per_node 1 \\
--rdzv_id $RANDOM \\
--rdzv_backend c10d \\
--rdzv_endpoint {endpoint} \\
{train} --steps=60 --step-time=0.05 --ckpt-dir={work}/ckpt --ckpt-every=5 \\
    --fail-at-step=20 --fail-rank=1 --result={work}/result.json
"""


@pytest.mark.parametrize(
    "endpoint",
    [
        "$head_node_ip:29500",  # the tutorial's
        "localhost:29500",  # names no node of a 3-node job: SLURM_PROCID 0 hosts the master
    ],
)
def test_torchrun_tutorial_script_runs_and_recovers(
    local_slurm: LocalSlurm, shared_tmp: Path, endpoint: str
) -> None:
    (shared_tmp / "ckpt").mkdir()
    script = shared_tmp / "multinode.sbatch"
    script.write_text(SCRIPT.format(train=TRAIN, work=shared_tmp, endpoint=endpoint))
    job = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-w",
            "node[1-3]",
            "-o",
            str(shared_tmp / "out-%j.txt"),
            str(script),
        ],
        cwd=shared_tmp,
        env=run_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    fields = wait_job(job, timeout_s=240)
    out = (shared_tmp / f"out-{job}.txt").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    job_dir = shared_tmp / ".dlrover-hpc" / job
    evs = events(job_dir)
    info = json.loads((job_dir / "master.json").read_text())
    assert info["embedded"] is True and info["port"] == 29500
    if endpoint.startswith("localhost"):
        assert "names none of this job's nodes" in out
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((job_dir / "token").stat().st_mode) == 0o600
    # The killed rank is the one failure; on a loaded machine its peers may see the closed
    # connection before their agents stop them, reported as failures of kind "peer".
    failures = named(evs, "worker_failed")
    [failed] = [e for e in failures if e["classification"] != "peer"]
    assert failed["signal"] == "SIGKILL" and failed["rank"] == 1
    assert all(e["rank"] != 1 for e in failures if e["classification"] == "peer"), failures
    assert named(evs, "workers_restarted"), out[-3000:]
    assert sorted(named(evs, "rendezvous_complete")[-1]["nodes"]) == ["node1", "node2", "node3"]
    result = json.loads((shared_tmp / "result.json").read_text())
    assert result["final_step"] == 60 and result["group_world_size"] == 3
