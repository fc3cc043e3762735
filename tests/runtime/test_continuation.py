"""Time limits lose nothing (issue 17) on the real local Slurm.  A job submitted with a short
``--time`` and ``--signal=B:USR1@30`` saves at a step boundary when the signal comes and ends
before its limit, twice: its first run continues by ``scontrol requeue`` (the templates'
``--requeue``), its second (no longer requeueable) by a job the master submits.  Each run
resumes from the step the one before saved: no step lost, none trained twice."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from runtime_helpers import TRAIN, events, job_fields, named, sbatch, wait_job

from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm
FLASH = TRAIN.parent / "train_flash_ckpt.py"
#: more than two runs can train however early Slurm's signal comes (each run of the 2-minute
#: job trains at most ~65 s, ~220 steps), and what the 8-minute last job trains before its
#: signal (its template asks USR1 2 minutes before the limit)
STEPS = 450


def _steps(log: Path) -> list[int]:
    if not log.exists():
        return []
    return [int(line.split()[1]) for line in log.read_text().splitlines() if line.strip()]


def _requeued_and_released(job: str, job_dir: Path) -> None:
    """Until the master requeued its job; then lift Slurm's 120 s hold on a requeued job
    (a cluster would simply wait) and make the next run end by resubmission instead."""
    wait_for(
        lambda: named(events(job_dir), "job_continued"),
        timeout_s=200,
        what=f"job {job} to continue",
    )

    def pending() -> bool:
        state = job_fields(job).get("JobState")
        if state == "PENDING":
            subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], timeout=10)
        return state in ("PENDING", "RUNNING") and job_fields(job).get("Restarts") == "1"

    wait_for(pending, timeout_s=60, what=f"job {job} to be requeued", interval_s=0.5)

    def requeue_off() -> bool:
        # A requeued job shows PENDING while Slurm still completes its last run's steps, and
        # until then it refuses updates ("Job has already finished", seen once in a clean-clone
        # run): ask again until it takes it. A job that really ended fails at the deadline.
        done = subprocess.run(
            ["scontrol", "update", f"jobid={job}", "Requeue=0"],
            timeout=10,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0 or "already finished" in done.stderr, done.stderr
        return done.returncode == 0

    wait_for(requeue_off, timeout_s=60, what=f"job {job} to take Requeue=0", interval_s=0.5)
    wait_for(
        lambda: job_fields(job).get("JobState") == "RUNNING",
        timeout_s=60,
        what=f"job {job} to run again",
        interval_s=0.5,
    )


@pytest.mark.timeout(900)
def test_time_limits_save_at_the_signal_and_each_continuation_loses_no_step(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    work = shared_tmp
    (work / "ckpt").mkdir()
    first = sbatch(
        work,
        2,
        "--nnodes=2:2",
        "--nproc-per-node=1",
        str(FLASH),
        f"--steps={STEPS}",
        f"--ckpt-dir={work / 'ckpt'}",
        "--save-every=1",
        "--persist-every=100000",  # only the stops persist: nothing else could hide a loss
        "--step-time=0.3",
        f"--timing-log={work / 'timing.log'}",
        f"--result={work / 'result.json'}",
        # The USR1 (60 s before the limit) comes first: the master's own trigger is later.
        # 60 s, not less: the workers' start may take half a minute on a loaded machine (tests
        # side by side), and Slurm checks its limits every 30 s, so the signal comes 30-60 s
        # into a run, and the stop must still save and commit before the limit.
        master_opts="--stop-lead=10",
        # Options given to sbatch are not visible to the job: a resubmission gets these (the
        # template's own --signal=B:USR1@120 then comes after the training is over).
        env={"DLROVER_HPC_CONTINUE_OPTS": "--time=8"},
        extra=("--time=2", "--signal=B:USR1@60", "--job-name=continued", "--open-mode=append"),
    )
    first_dir = work / ".dlrover-hpc" / first
    _requeued_and_released(first, first_dir)
    fields = wait_job(first, timeout_s=240)
    out = (work / f"slurm-{first}.out").read_text()
    assert fields["JobState"] == "COMPLETED", (fields, out)  # by itself, before its limit
    evs = events(first_dir)
    reached = named(evs, "time_limit_reached")
    continued = named(evs, "job_continued")
    assert [e["how"] for e in continued] == ["requeue", "resubmit"], continued
    assert [e["continuation"] for e in continued] == [1, 2]
    assert continued[0]["job"] == first
    saved = [e["step"] for e in reached]
    assert len(saved) == 2 and saved == [e["step"] for e in continued]
    assert all(e["step"] == e["stop_step"] > 0 for e in reached), reached  # saved every step
    committed = [e["step"] for e in named(evs, "checkpoint_persisted") if e["committed"]]
    assert committed == saved  # persisted and committed before each run ended
    finished = named(evs, "job_finished")
    assert len(finished) == 2 and all(
        e["exit_code"] == 0 and "time_limit" in e["reason"] for e in finished
    )
    assert (first_dir / "journal.run0.jsonl").exists()  # the second run started afresh

    # The continuation of the second run: the same script, nodes and arguments.
    second = continued[1]["job"]
    fields2 = wait_job(second, timeout_s=420)
    out2 = (work / f"slurm-{second}.out").read_text()
    assert fields2["JobState"] == "COMPLETED", (fields2, out2)
    assert fields2["JobName"] == "continued" and fields2["NumNodes"] == "2"
    assert fields2["TimeLimit"] == "00:08:00"  # DLROVER_HPC_CONTINUE_OPTS came last
    evs2 = events(work / ".dlrover-hpc" / second)
    assert not named(evs2, "time_limit_reached") and not named(evs2, "job_continued")
    result = json.loads((work / "result.json").read_text())
    assert result["start_step"] == saved[1] and result["final_step"] == STEPS

    # Every run resumed from storage at the step the one before saved: 0 lost, 0 repeated.
    restored = named(evs, "checkpoint_restored") + named(evs2, "checkpoint_restored")
    assert {(e["step"], e["source"]) for e in restored} == {(s, "storage") for s in saved}
    # Rank 0 logs a step after its save; at a stop step the save ends the run first.  So the
    # log and the stop steps together hold every step exactly once: none lost, none repeated.
    logged = _steps(work / "timing.log")
    assert sorted(logged + saved) == list(range(1, STEPS + 1)), (saved, logged)
