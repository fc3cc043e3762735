"""The node-local checkpoint tier (--local-ckpt-dir) on the real local Slurm: a requeued job
restores on the same nodes from local disk, not from the shared directory.

A 2-node job saves each rank's own part (``--sharded``) and persists every few steps; at its
time limit the master saves, commits and requeues it (as in test_continuation.py).  Before the
requeued run starts, the test wipes the job's shared-memory segments (as a cluster's per-job
/dev/shm is wiped at a job's end), makes rank 0's shared copy of the newest committed step
unreadable, and removes rank 1's node's local tier.  The requeued run must restore that step on
both nodes: rank 0 from its node's local tier (the shared copy it never read is garbage), rank
1 from the shared directory.  When the job ends for good, the local tier is gone.  (The local
Slurm's nodes share one disk; the tier keeps each node's under its own name.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from runtime_helpers import events, job_fields, named, sbatch

from dlrover_hpc.checkpoint.saver.local_tier import LocalRecord, job_key
from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm
FLASH = Path(__file__).resolve().parents[2] / "examples" / "train_flash_ckpt.py"
#: more than the first run trains before its time limit's signal (60-90 s into it, ~170-270
#: steps), less than the requeued run trains before its own (at most ~40 s of steps left)
STEPS = 300


def _committed(job_dir: Path) -> list[int]:
    return [e["step"] for e in named(events(job_dir), "checkpoint_persisted") if e["committed"]]


def _node_tiers(local: Path, job: str) -> dict[str, Path]:
    """node name -> that node's tier of the job's checkpoint directory."""
    out = {}
    for node in ("node1", "node2"):
        node_dir = local / job_key(job, node)
        if node_dir.is_dir():
            (out[node],) = [p for p in node_dir.iterdir() if p.is_dir()]
    return out


def _ranks_held(tier: Path, step: int) -> tuple[int, ...]:
    raw = (tier / ".dlrover-hpc" / "local" / f"step-{step:012d}.json").read_bytes()
    return LocalRecord.from_json(raw).ranks


@pytest.mark.timeout(600)
def _ended_lifting_holds(job: str) -> dict[str, str]:
    fields = job_fields(job)
    state = fields.get("JobState")
    if state == "PENDING":
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=10)
    return fields if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") else {}


def test_a_requeued_job_restores_from_the_local_tier_and_the_shared_one_where_it_lacks(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    ckpt, local = shared_tmp / "ckpt", shared_tmp / "local"
    job = sbatch(
        shared_tmp,
        2,
        "--nnodes=2:2",
        "--nproc-per-node=1",
        f"--local-ckpt-dir={local}",
        str(FLASH),
        f"--steps={STEPS}",
        f"--ckpt-dir={ckpt}",
        "--sharded",
        "--save-every=1",
        "--persist-every=5",
        "--keep-last=3",
        "--step-time=0.3",
        f"--result={shared_tmp / 'result.json'}",
        master_opts="--stop-lead=10",
        extra=("-w", "node[1-2]", "--time=2", "--signal=B:USR1@60", "--open-mode=append"),
    )
    job_dir = shared_tmp / ".dlrover-hpc" / job
    wait_for(
        lambda: named(events(job_dir), "job_continued"),
        timeout_s=240,
        what=f"job {job} to save at its time limit and requeue",
    )
    wait_for(
        lambda: (f := job_fields(job)).get("JobState") == "PENDING" and f.get("Restarts") == "1",
        timeout_s=120,
        what="the requeued job to pend",
        interval_s=0.5,
    )
    requeued_at = max(e["time"] for e in events(job_dir))
    # The first run is over: its newest committed step is the one the next run restores.
    step = int((ckpt / "dlrover_latest.txt").read_text())
    # No memory tier: the agents of a run that stopped to continue remove their segments (and
    # a cluster wipes the job's /dev/shm at its end); whatever is left goes here.
    for node in ("node1", "node2"):
        wipe = f"find /dev/shm -maxdepth 1 -name '*{job}*' -delete"
        argv = [*local_slurm.node_exec_argv(node), "sh", "-c", wipe]
        subprocess.run(argv, check=True, timeout=30)
    tiers = _node_tiers(local, job)
    assert sorted(tiers) == ["node1", "node2"], tiers
    holder = {_ranks_held(t, step): n for n, t in tiers.items()}
    assert sorted(holder) == [(0,), (1,)], holder  # each node holds its own rank's part
    node0, node1 = holder[(0,)], holder[(1,)]
    local0 = tiers[node0] / f"checkpoint-{step}" / "rank_00000.pt"
    shared0 = ckpt / f"checkpoint-{step}" / "rank_00000.pt"
    assert local0.read_bytes() == shared0.read_bytes()
    shared0.write_bytes(b"\0" * shared0.stat().st_size)  # unreadable: it must not be read
    shutil.rmtree(tiers[node1].parent)  # rank 1's node lacks the step: it reads the shared one
    # Lift Slurm's 120 s hold on a requeued job (a cluster would simply wait), each time: on a
    # loaded machine a run can reach its time limit again and continue once more (CI's did).
    fields = wait_for(
        lambda: _ended_lifting_holds(job), timeout_s=600, what=f"job {job} to end", interval_s=1
    )
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    evs = [e for e in events(job_dir) if e["time"] > requeued_at]
    restored = sorted(
        (e["node"], e["source"], e["step"]) for e in named(evs, "checkpoint_restored")
    )
    first = [r for r in restored if r[2] == step]
    assert first == sorted([(node0, "local", step), (node1, "storage", step)]), (
        restored,
        out[-4000:],
    )
    # On a loaded machine the second run can reach its time limit too and continue once more:
    # then both nodes hold that newer step in their tiers and restore it from there.
    later = [r for r in restored if r[2] != step]
    assert all(src == "local" and s > step for _, src, s in later), (restored, out[-4000:])
    assert not named(evs, "restore_rejected"), out[-4000:]
    result = json.loads((shared_tmp / "result.json").read_text())
    newest = max(s for _, _, s in restored)
    assert result["final_step"] == STEPS and result["start_step"] == newest, result
    # The job ended for good: its local tier went with its segments.
    assert not _node_tiers(local, job), list(local.iterdir())
    print(
        f"local tier requeue: restored step {step}: {node0} (rank 0) from local disk, "
        f"{node1} (rank 1) from the shared directory"
    )
