"""Elastic data (issue 16) on the real local Slurm: a job goes 4 -> 3 -> 4 nodes (node4 crashes,
comes back and is admitted again) and still trains every sample of the epoch exactly once, each
optimizer step on the same 24 samples as an undisturbed run, with the same loss curve up to
float summation order.  The reference run is a single process accumulating 12 micro-batches:
the global batch, not the world size, fixes the numbers."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from runtime_helpers import BIN, TRAIN, events, jsonl_records, named, sbatch, wait_job

from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm
ELASTIC = TRAIN.parent / "train_elastic.py"
SAMPLES, GLOBAL = 4800, 24


def surviving_steps(records: list[dict]) -> tuple[dict[int, list[int]], dict[int, float]]:
    """Step -> its samples (all ranks) and rank 0's loss, for the steps the model kept: a round
    that resumed at step ``s`` rolled back every later step of the rounds before it."""
    starts: dict[int, int] = {}
    for r in records:
        if "start" in r:
            starts[r["round"]] = r["start"]
    samples: dict[int, list[int]] = {}
    losses: dict[int, float] = {}
    for r in records:
        if "samples" not in r:
            continue
        later = [s for k, s in starts.items() if k > r["round"]]
        if later and r["step"] > min(later):
            continue
        samples.setdefault(r["step"], []).extend(r["samples"])
        if "loss" in r:
            losses[r["step"]] = r["loss"]
    return samples, losses


def _worlds(records: list[dict]) -> list[int]:
    firsts = {r["round"]: r["world"] for r in records if "start" in r}
    return [firsts[k] for k in sorted(firsts)]


def test_the_global_batch_and_the_samples_survive_4_3_4_nodes(
    local_slurm: LocalSlurm, shared_tmp: Path, tmp_path: Path
) -> None:
    work = shared_tmp
    args = [str(ELASTIC), f"--samples={SAMPLES}", f"--global-batch={GLOBAL}", "--micro-batch=2"]
    ref = tmp_path / "reference"
    run = [str(BIN / "dlrover-run"), "--standalone", "--nproc-per-node=1", f"--job-dir={ref}/job"]
    subprocess.run(
        [*run, *args, f"--ckpt-dir={ref / 'ckpt'}", f"--sample-log={ref / 'log'}"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=300,
    )
    log_dir = work / "log"
    slow = work / "slow"  # the epoch held open (1 s steps) from node4's crash to its return
    job = sbatch(
        work,
        4,
        "--nnodes=3:4",
        "--nproc-per-node=1",
        *args,
        f"--ckpt-dir={work / 'ckpt'}",
        f"--sample-log={log_dir}",
        "--step-time=0.15",
        f"--slow-while={slow}",
    )

    def on_3(steps: int) -> bool:  # the newest round is on 3 nodes and trained ``steps``
        records = jsonl_records(log_dir)
        starts = {r["round"]: r for r in records if "start" in r}
        last = starts[max(starts)] if starts else {}
        return last.get("world") == 3 and any(
            r["round"] == last["round"] and r["step"] >= last["start"] + steps
            for r in records
            if "samples" in r
        )

    try:
        wait_for(
            lambda: any(r.get("step", 0) >= 40 for r in jsonl_records(log_dir)),
            timeout_s=180,
            what="step 40",
        )
        slow.touch()
        local_slurm.kill_node("node4")
        wait_for(lambda: on_3(5), timeout_s=120, what="5 steps on 3 nodes")
        local_slurm.restart_node("node4")  # repaired: the job takes it back
        wait_for(
            lambda: _worlds(jsonl_records(log_dir))[-2:] == [3, 4],
            timeout_s=240,
            what="back on 4 nodes",
        )
        slow.unlink()
        fields = wait_job(job, timeout_s=300)
    finally:
        slow.unlink(missing_ok=True)
        subprocess.run(["scancel", job], check=False, timeout=30)
        local_slurm.restart_node("node4")
    out = (work / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    records = jsonl_records(log_dir)
    worlds = _worlds(records)
    assert worlds[0] == 4 and 3 in worlds and worlds[-1] == 4, (worlds, out[-3000:])
    assert named(events(work / ".dlrover-hpc" / job), "node_lost")

    samples, losses = surviving_steps(records)
    reference, ref_losses = surviving_steps(jsonl_records(ref / "log"))
    assert sorted(samples) == sorted(reference) == list(range(1, SAMPLES // GLOBAL + 1))
    trained = [i for step in samples.values() for i in step]
    assert sorted(trained) == list(range(SAMPLES))  # every sample once
    for step, got in samples.items():
        assert len(got) == GLOBAL and sorted(got) == sorted(reference[step]), step
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-4), step
