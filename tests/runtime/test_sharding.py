"""Dynamic data sharding (issue 16 item 4) on the real local Slurm: the master hands out shards
to 8 ranks; a worker is killed, then a node is lost; every sample of both epochs reaches the
model exactly once (the samples of steps rolled back by a restore do not count)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from runtime_helpers import TRAIN, events, jsonl_records, named, sbatch, wait_job

from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm
SHARDED = TRAIN.parent / "train_sharded.py"
SAMPLES, EPOCHS = 1200, 2


def trained_samples(records: list[dict]) -> Counter[int]:
    """Samples of the steps that survived: a round resumed at ``start`` rolls back every step
    after it, of every earlier round."""
    starts: dict[int, int] = {}
    for r in records:
        if "start" in r:
            starts[r["round"]] = min(r["start"], starts.get(r["round"], r["start"]))
    seen: Counter[int] = Counter()
    for r in records:
        if "samples" not in r:
            continue
        later = [s for k, s in starts.items() if k > r["round"]]
        if not later or r["step"] <= min(later):
            seen.update(r["samples"])
    return seen


def test_every_sample_is_trained_once_through_a_worker_kill_and_a_node_loss(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    work = shared_tmp
    (work / "ckpt").mkdir()
    log_dir = work / "samples"
    job = sbatch(
        work,
        4,
        "--nnodes=3:4",
        "--nproc-per-node=2",
        "--max-restarts=2",
        str(SHARDED),
        f"--samples={SAMPLES}",
        f"--epochs={EPOCHS}",
        "--batch-size=4",
        "--shard-size=24",
        f"--ckpt-dir={work / 'ckpt'}",
        "--save-every=3",
        "--step-time=0.15",
        f"--sample-log={log_dir}",
        "--fail-at-step=16",
        "--fail-rank=3",
    )
    job_dir = work / ".dlrover-hpc" / job
    try:
        wait_for(
            lambda: any(
                r.get("round", 0) >= 2 and r.get("step", 0) >= 30 for r in jsonl_records(log_dir)
            ),
            timeout_s=180,
            what="the restarted round to train past step 30",
        )
        local_slurm.kill_node("node4")
        fields = wait_job(job, timeout_s=300)
    finally:
        local_slurm.restart_node("node4")
    out = (work / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    evs = events(job_dir)
    assert [e["node"] for e in named(evs, "node_lost")] == ["node4"]
    assert any(e.get("signal") == "SIGKILL" for e in named(evs, "worker_failed"))
    records = jsonl_records(log_dir)
    rounds = {r["round"] for r in records if "start" in r}
    assert len(rounds) >= 3, rounds  # the first, after the kill, after the loss
    seen = trained_samples(records)
    twice = {i: n for i, n in seen.items() if n > EPOCHS}
    missing = [i for i in range(SAMPLES) if seen[i] < EPOCHS]
    assert not twice and not missing, (
        f"trained too often: {dict(list(twice.items())[:10])}",
        missing[:10],
    )
    assert sum(seen.values()) == SAMPLES * EPOCHS
    assert (job_dir / "datasets.jsonl").exists()
