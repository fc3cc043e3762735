"""Time limits lose nothing (issue 17) on the real local Slurm: a job submitted with a short
``--time`` and ``--signal=B:USR1@30`` saves at a step boundary when the signal comes, ends
before its limit, and continues in a job the master submits; that job resumes from the saved
step and trains to the end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_helpers import TRAIN, events, named, sbatch, wait_job

from dlrover_hpc.testing import LocalSlurm

pytestmark = pytest.mark.slurm
FLASH = TRAIN.parent / "train_flash_ckpt.py"
STEPS = 240


def _steps(log: Path) -> list[int]:
    if not log.exists():
        return []
    return [int(line.split()[1]) for line in log.read_text().splitlines() if line.strip()]


def test_time_limit_saves_at_the_signal_and_the_continuation_loses_no_step(
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
        "--persist-every=100000",  # only the stop persists: nothing else could hide a loss
        "--step-time=0.4",
        f"--timing-log={work / 'timing.log'}",
        f"--result={work / 'result.json'}",
        # The USR1 (30 s before the limit) comes first: the master's own trigger is later.
        master_opts="--stop-lead=10",
        # Options given to sbatch are not visible to the job: the continuation gets these.
        env={"DLROVER_HPC_CONTINUE_OPTS": "--signal=B:USR1@30"},
        extra=("--time=2", "--signal=B:USR1@30", "--no-requeue", "--job-name=continued"),
    )
    first_dir = work / ".dlrover-hpc" / first
    fields = wait_job(first, timeout_s=240)
    evs = events(first_dir)
    # It ended by itself, before Slurm's limit, and said where it stopped.
    assert fields["JobState"] == "COMPLETED", (fields, (work / f"slurm-{first}.out").read_text())
    (reached,) = named(evs, "time_limit_reached")
    (continued,) = named(evs, "job_continued")
    step = reached["step"]
    assert step == reached["stop_step"] > 0, reached  # saved every step: at the stop step
    assert continued["how"] == "resubmit" and continued["step"] == step
    assert continued["continuation"] == 1
    trained_before = _steps(work / "timing.log")
    assert trained_before and max(trained_before) <= step  # nothing trained past the save
    committed = [e["step"] for e in named(evs, "checkpoint_persisted") if e["committed"]]
    assert committed == [step]  # persisted and committed before the job ended
    (finished,) = named(evs, "job_finished")
    assert finished["exit_code"] == 0 and "time_limit" in finished["reason"]

    # The continuation: the same script, nodes and arguments, after the first job.
    second = continued["job"]
    assert second != first
    fields2 = wait_job(second, timeout_s=240)
    out2 = (work / f"slurm-{second}.out").read_text()
    assert fields2["JobState"] == "COMPLETED", (fields2, out2)
    assert fields2["JobName"] == "continued" and fields2["NumNodes"] == "2"
    evs2 = events(work / ".dlrover-hpc" / second)
    restored = named(evs2, "checkpoint_restored")
    assert restored and {e["step"] for e in restored} == {step}, restored
    assert {e["source"] for e in restored} == {"storage"}  # a new job: memory is gone
    result = json.loads((work / "result.json").read_text())
    assert result["start_step"] == step and result["final_step"] == STEPS
    after = _steps(work / "timing.log")[len(trained_before) :]
    assert after[0] == step + 1 and after[-1] == STEPS, after[:3]  # 0 lost, 0 repeated
    assert not named(evs2, "time_limit_reached") and not named(evs2, "job_continued")
