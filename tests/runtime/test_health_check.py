"""Health before joining on the real local Slurm (issue 48): a site ``--health-check`` that
fails on exactly one node of a 3-node allocation.  That node never trains (no workers, in no
round), its reason is in the logs, in events.jsonl (node_unhealthy), in ``status`` and in
``report``, and the job completes on the other two (``--nnodes=2:3``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from runtime_helpers import BIN, TRAIN, events, named, sbatch, wait_job, wait_training

from dlrover_hpc.localslurm import LocalSlurm

pytestmark = pytest.mark.slurm

FLASH = TRAIN.parent / "train_flash_ckpt.py"  # flash checkpoints: the saver sees them
REASON = "ERROR: fake nhc failure on node3"
NHC = """#!/bin/sh
# A stand-in for NHC: healthy everywhere but on node3.
if [ "$(hostname)" = node3 ]; then
    echo "ERROR: fake nhc failure on $(hostname)"
    echo "a second line that is not the reason"
    exit 1
fi
exit 0
"""


def test_a_node_failing_the_site_health_check_never_trains(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    nhc = shared_tmp / "nhc.sh"
    nhc.write_text(NHC)
    nhc.chmod(0o755)
    (shared_tmp / "ckpt").mkdir()
    steps = 80
    job = sbatch(
        shared_tmp,
        3,
        "--nnodes=2:3",
        "--nproc-per-node=1",
        f"--health-check={nhc}",
        str(TRAIN),
        f"--steps={steps}",
        f"--ckpt-dir={shared_tmp / 'ckpt'}",
        "--ckpt-every=10",
        "--step-time=0.1",
        f"--result={shared_tmp / 'result.json'}",
        extra=("-w", "node[1-3]"),
        # quarantine: the node is kept out without changing the local Slurm's node states;
        # no replacement job: this test is about the node that never trains
        master_opts="--drain=quarantine --replacement-sbatch=off",
    )
    job_dir = shared_tmp / ".dlrover-hpc" / job
    wait_training(shared_tmp, job, 5)
    dlrover_hpc = str(BIN / "dlrover-hpc")
    status = subprocess.run(  # from node2: it resolves the master's host name
        [*local_slurm.node_exec_argv("node2"), dlrover_hpc, "status", "--job-dir", str(job_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    fields = wait_job(job, timeout_s=240)
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    evs = events(job_dir)

    [unhealthy] = named(evs, "node_unhealthy")
    assert (unhealthy["node"], unhealthy["check"], unhealthy["reason"]) == (
        "node3",
        "program",
        REASON,
    ), unhealthy
    assert any(line.startswith("program=failed") for line in unhealthy["checks"]), unhealthy
    [quarantined] = named(evs, "node_quarantined")
    assert quarantined["node"] == "node3" and REASON in quarantined["reason"], quarantined
    # never trained: no workers there, in no round
    assert "node3" not in {e["node"] for e in named(evs, "workers_started")}
    rounds = named(evs, "rendezvous_complete")
    assert rounds and all("node3" not in r["nodes"] for r in rounds), rounds
    assert sorted(rounds[-1]["nodes"]) == ["node1", "node2"]
    result = json.loads((shared_tmp / "result.json").read_text())
    assert result["final_step"] == steps and result["group_world_size"] == 2, result
    assert named(evs, "job_finished")[-1]["exit_code"] == 0
    # the reason in the agent's and the master's log lines (the job's output)
    assert f"node unhealthy check=program reason={REASON}: it does not join" in out, out[-4000:]
    assert f"node unhealthy node=node3 check=program reason={REASON}" in out, out[-4000:]
    # the healthy nodes ran every check and say what was skipped
    assert out.count("node healthy shm=") >= 2, out[-4000:]

    assert status.returncode == 0, status.stderr
    [row] = [line for line in status.stdout.splitlines() if line.startswith("node3")]
    assert "excluded" in row and REASON in row, status.stdout
    report = subprocess.run(
        [dlrover_hpc, "report", "--job-dir", str(job_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    nodes = {n["node"]: n for n in json.loads(report.stdout)["nodes"]}
    assert REASON in nodes["node3"]["removed"], nodes
    text = subprocess.run(
        [dlrover_hpc, "report", "--job-dir", str(job_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "node3" in text and "unhealthy" in text, text


NHC_ONCE = """#!/bin/sh
# Healthy at each node's first check; unhealthy at any later one (a node gone bad meanwhile).
mark="{dir}/checked-$(hostname)"
if [ -e "$mark" ]; then
    echo "ERROR: fake nhc: $(hostname) went bad"
    exit 1
fi
touch "$mark"
exit 0
"""


def test_a_node_whose_workers_failed_checks_itself_again(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    """A worker SIGKILLed (its own failure, not a lost peer's): its node runs the checks again
    before it re-joins, now with a checkpoint seen (shm and storage are checked, not skipped);
    the site program fails there this time, so the node is out and the job completes on the
    other two.  Its peers' nodes, whose workers only lost it, re-join without a check."""
    marks = shared_tmp / "marks"
    marks.mkdir()
    nhc = shared_tmp / "nhc-once.sh"
    nhc.write_text(NHC_ONCE.format(dir=marks))
    nhc.chmod(0o755)
    (shared_tmp / "ckpt").mkdir()
    steps = 80
    job = sbatch(
        shared_tmp,
        3,
        "--nnodes=2:3",
        "--nproc-per-node=1",
        f"--health-check={nhc}",
        str(FLASH),
        f"--steps={steps}",
        f"--ckpt-dir={shared_tmp / 'ckpt'}",
        "--save-every=2",
        "--persist-every=10",
        "--fail-at-step=20",
        "--fail-rank=2",
        "--step-time=0.1",
        f"--result={shared_tmp / 'result.json'}",
        extra=("-w", "node[1-3]"),
        master_opts="--drain=quarantine --replacement-sbatch=off",
    )
    job_dir = shared_tmp / ".dlrover-hpc" / job
    fields = wait_job(job, timeout_s=240)
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    evs = events(job_dir)
    own = [e for e in named(evs, "worker_failed") if e["classification"] != "peer"]
    assert [e["rank"] for e in own] == [2], named(evs, "worker_failed")
    bad = own[0]["node"]
    [unhealthy] = named(evs, "node_unhealthy")
    assert unhealthy["node"] == bad and unhealthy["check"] == "program", unhealthy
    assert unhealthy["reason"] == f"ERROR: fake nhc: {bad} went bad", unhealthy
    assert unhealthy["time"] > own[0]["time"]
    # with a checkpoint on the node: room in /dev/shm and the directory's fsync were checked
    lines = unhealthy["checks"]
    assert any(line.startswith("shm=ok") for line in lines), lines
    assert any(line.startswith("storage=ok") for line in lines), lines
    # it trained in the first round only, and the job ended on the other two
    started = [e["round"] for e in named(evs, "workers_started") if e["node"] == bad]
    assert started == [1], named(evs, "workers_started")
    rounds = named(evs, "rendezvous_complete")
    assert bad not in rounds[-1]["nodes"] and len(rounds[-1]["nodes"]) == 2, rounds
    result = json.loads((shared_tmp / "result.json").read_text())
    # The failure is charged, or not when the node's exclusion re-formed the round first (a
    # membership change spends no restart): which comes first is a race, both are right.
    assert result["final_step"] == steps and result["restart_count"] in (0, 1), result
    # only the failed node checked itself twice
    assert sorted(p.name for p in marks.iterdir()) == [f"checked-node{i}" for i in (1, 2, 3)]
    assert out.count("node unhealthy check=program") == 1, out[-4000:]
