"""``--persist-every`` on the real local Slurm (issue 49): a script that saves only to memory
(every step) gets steps committed on storage at the interval, chosen for it (``auto``) or fixed;
each node persists the same step from its shared memory, so every one commits."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
from pathlib import Path

import pytest
from runtime_helpers import BIN, TRAIN, events, named, sbatch, wait_job

from dlrover_hpc.checkpoint.saver.commit_records import CheckpointDir
from dlrover_hpc.checkpoint.saver.storage import Storage
from dlrover_hpc.localslurm import LocalSlurm
from dlrover_hpc.master.persist_interval import daly_interval

pytestmark = pytest.mark.slurm
FLASH = TRAIN.parent / "train_flash_ckpt.py"
STEPS = 200  # 0.1 s each: 20 s of training
#: 2 nodes of 500 s each: the job's MTBF is 250 s, so with a persist of ~0.05 s Young/Daly
#: gives about 5 s
NODE_MTBF_S = 500.0


def _job(work: Path, *flags: str) -> tuple[Path, list[dict], list[tuple[int, float]], dict]:
    ckpt = work / "ckpt"
    job = sbatch(
        work,
        2,
        "--nnodes=2",
        "--nproc-per-node=1",
        *flags,
        str(FLASH),
        f"--steps={STEPS}",
        f"--ckpt-dir={ckpt}",
        "--save-every=1",  # to memory, every step
        f"--persist-every={10 * STEPS}",  # the script's own DISK save: only its last step
        "--keep-last=1000",  # every commit record stays, to be read here
        "--sharded",  # a part per rank: a step commits only when both nodes persist it
        "--step-time=0.1",
    )
    fields = wait_job(job, timeout_s=300)
    out = (work / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    job_dir = work / ".dlrover-hpc" / job
    records = CheckpointDir(str(ckpt), Storage(str(ckpt))).records()
    commits = sorted((r.step, r.time) for r in records)
    reported = subprocess.run(
        [str(BIN / "dlrover-hpc"), "report", "--job-dir", str(job_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return job_dir, events(job_dir), commits, json.loads(reported.stdout)


def _gaps(commits: list[tuple[int, float]]) -> list[float]:
    """Seconds between the commits the master asked for (the script's last step left out)."""
    asked = [t for step, t in commits if step != STEPS]
    return [b - a for a, b in itertools.pairwise(asked)]


def test_memory_only_saves_become_durable_at_the_interval_auto_chooses(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    job_dir, evs, commits, report = _job(
        shared_tmp, "--persist-every=auto", f"--node-mtbf={NODE_MTBF_S:g}s"
    )
    chosen = named(evs, "persist_interval")
    assert chosen, [e["event"] for e in evs]
    first = chosen[0]
    assert first["mode"] == "auto" and first["mtbf_source"] == "site", first
    assert first["mtbf_s"] == pytest.approx(NODE_MTBF_S / 2), first
    assert first["persist_s"] > 0, first
    for e in chosen:
        assert e["interval_s"] == pytest.approx(
            daly_interval(e["persist_s"], e["mtbf_s"]), rel=1e-3, abs=1e-3
        ), e
    # Nothing but the last step would be on storage without it; now steps trained commit
    # all along, each on both nodes (their parts: one commit record per step).
    steps = [s for s, _ in commits]
    assert len(steps) >= 4 and steps[-1] == STEPS, commits
    gaps = _gaps(commits)
    interval = chosen[-1]["interval_s"]
    # never much sooner than the interval (the step is asked ahead at a projected step rate,
    # which a loaded machine's steps outrun at times: one gap of 2.2 s for 3.9 s was seen)
    assert all(g >= 0.4 * min(e["interval_s"] for e in chosen) for g in gaps), (gaps, chosen)
    assert statistics.median(gaps) >= 0.6 * min(e["interval_s"] for e in chosen), (gaps, chosen)
    # about the interval: the step is asked a heartbeat and a second ahead (its own lead)
    assert statistics.median(gaps) <= interval + 6.0, (gaps, interval)
    persisted = {e["step"] for e in named(evs, "checkpoint_persisted") if e.get("committed")}
    assert set(steps) <= persisted, (steps, persisted)
    assert "auto" in report["persist_interval"] and "site" in report["persist_interval"], report
    assert report["last_checkpoint_step"] == STEPS, report
    text = subprocess.run(
        [str(BIN / "dlrover-hpc"), "report", "--job-dir", str(job_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "persist interval:" in text, text


def test_a_fixed_persist_interval(local_slurm: LocalSlurm, shared_tmp: Path) -> None:
    _, evs, commits, report = _job(shared_tmp, "--persist-every=4")
    [chosen] = named(evs, "persist_interval")
    assert chosen["mode"] == "fixed" and chosen["interval_s"] == 4.0, chosen
    gaps = _gaps(commits)
    assert len(gaps) >= 2, commits
    # generous on a loaded 2-core machine, where the projected step runs early (CI saw gaps
    # of 1.9 and 2.1 s before 4.2-4.9 s); never a burst of commits, about the interval
    assert all(g >= 4.0 * 0.4 for g in gaps), gaps
    assert 4.0 * 0.6 <= statistics.median(gaps) <= 4.0 + 6.0, gaps
    assert report["persist_interval"] == "4.0 s (fixed)", report
