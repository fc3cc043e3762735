"""Slurm's USR1 and the frameworks that requeue on it (issue 27, items 1 and 2), on the local
Slurm: two jobs side by side, each a script that installs a USR1 handler as Lightning's
auto-requeue does, and records the Slurm variables it sees.

- ``--requeue-by=dlrover-hpc`` (the default): ``scancel --signal=USR1`` (what
  ``--signal=USR1@T`` does: every process of every step) stops the job at a step boundary
  through the master; no worker's handler runs, no agent dies of it.
- ``--requeue-by=framework``: the template's trap passes the batch shell's USR1 on to the
  steps; each worker's handler runs once, the master stops nothing and the job trains on.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from runtime_helpers import TRAIN, events, named, sbatch, wait_job

from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm

#: A flash-checkpoint DDP script: it keeps its first save at or after the master's stop step.
FLASH = TRAIN.parent / "train_flash_ckpt.py"
#: A framework's part: a USR1 handler (Lightning's requeues), then the training script.
WRAPPER = f"""
import json, os, runpy, signal, sys
out = sys.argv.pop(1)
rank = os.environ["RANK"]
def on_usr1(sig, frame):
    with open(os.path.join(out, f"usr1-rank{{rank}}-{{os.getpid()}}"), "a") as f:
        f.write("USR1\\n")
signal.signal(signal.SIGUSR1, on_usr1)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
        "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID", "SLURM_NTASKS_PER_NODE",
        "DLROVER_HPC_AGENT_SLURM_PROCID", "DLROVER_HPC_AGENT_SLURM_NTASKS"]
seen = {{k: os.environ.get(k) for k in keys}}
seen["title"] = open("/proc/self/cmdline").read().replace("\\0", " ").strip()
with open(os.path.join(out, f"env-rank{{rank}}.json"), "w") as f:
    json.dump(seen, f)
sys.argv[0] = {str(FLASH)!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _start(work: Path, nodes: str, steps: int, *flags: str, master_opts: str = "") -> str:
    work.mkdir()
    (work / "ckpt").mkdir()
    script = work / "framework_train.py"
    script.write_text(WRAPPER)
    return sbatch(
        work,
        2,
        "--nnodes=2",
        "--nproc-per-node=2",
        *flags,
        str(script),
        str(work),
        f"--steps={steps}",
        "--step-time=0.1",
        f"--ckpt-dir={work / 'ckpt'}",
        "--save-every=2",
        "--persist-every=10",
        f"--result={work / 'result.json'}",
        f"--timing-log={work / 'timing.log'}",
        extra=("-w", nodes),
        master_opts=master_opts,
    )


def _wait_step(work: Path, step: int) -> None:
    """Until rank 0 has logged ``step`` steps (its --timing-log: a line per step)."""
    log = work / "timing.log"
    wait_for(
        lambda: log.exists() and len(log.read_text().splitlines()) >= step,
        timeout_s=120,
        what=f"{work.name}: step {step}",
        interval_s=0.3,
    )


def _check_worker_env(work: Path) -> None:
    """Every worker's Slurm task variables agree with its torchrun ranks (Lightning 2.0/2.1
    read SLURM_PROCID first); the agent's own are kept; ps shows the script."""
    for rank in range(4):
        seen = json.loads((work / f"env-rank{rank}.json").read_text())
        assert seen["SLURM_PROCID"] == seen["RANK"] == str(rank), seen
        assert seen["SLURM_LOCALID"] == seen["LOCAL_RANK"] == str(rank % 2), seen
        assert seen["SLURM_NTASKS"] == seen["WORLD_SIZE"] == "4", seen
        assert seen["SLURM_NODEID"] == seen["GROUP_RANK"] == str(rank // 2), seen
        assert seen["SLURM_NTASKS_PER_NODE"] == seen["LOCAL_WORLD_SIZE"] == "2", seen
        # srun --ntasks-per-node=1 -N2: the agents are tasks 0 and 1 of 2
        assert seen["DLROVER_HPC_AGENT_SLURM_NTASKS"] == "2", seen
        assert seen["DLROVER_HPC_AGENT_SLURM_PROCID"] in ("0", "1"), seen
        assert f" -u {work / 'framework_train.py'} {work} --steps=" in seen["title"], seen


def test_usr1_is_the_masters_by_default_and_the_frameworks_when_asked(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    ours, theirs = shared_tmp / "ours", shared_tmp / "theirs"
    job_ours = _start(ours, "node[1-2]", 600, master_opts="--max-continuations=0")
    job_theirs = _start(theirs, "node[3-4]", 150, "--requeue-by=framework")
    try:
        _wait_step(ours, 10)
        # --signal=USR1@T without B: Slurm signals every process of every step
        subprocess.run(["scancel", "--signal=USR1", job_ours], check=True, timeout=30)
        _wait_step(theirs, 10)
        # --signal=B:USR1@T: the batch shell's trap passes it on to the steps
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_theirs], check=True, timeout=30)
        fields_ours = wait_job(job_ours, timeout_s=180)
        fields_theirs = wait_job(job_theirs, timeout_s=180)
    finally:
        subprocess.run(["scancel", job_ours, job_theirs], check=False, timeout=30)

    out = (ours / f"slurm-{job_ours}.out").read_text()
    assert fields_ours["JobState"] == "COMPLETED", out[-4000:]
    evs = events(ours / ".dlrover-hpc" / job_ours)
    stopped = named(evs, "job_preempted") + named(evs, "time_limit_reached")
    assert len(stopped) == 1 and "SIGUSR1" in stopped[0]["reason"], stopped
    assert stopped[0]["step"] < 600  # stopped at a step boundary, well before the end
    assert not named(evs, "node_lost") and not named(evs, "worker_failed"), out[-4000:]
    assert named(evs, "job_finished")[-1]["exit_code"] == 0
    assert not list(ours.glob("usr1-*")), "a worker took the master's USR1"
    assert "SIGUSR1: the job master saves and continues the job" in out
    _check_worker_env(ours)

    out = (theirs / f"slurm-{job_theirs}.out").read_text()
    assert fields_theirs["JobState"] == "COMPLETED", out[-4000:]
    evs = events(theirs / ".dlrover-hpc" / job_theirs)
    assert not named(evs, "job_preempted") and not named(evs, "time_limit_reached"), evs
    assert json.loads((theirs / "result.json").read_text())["final_step"] == 150
    marks = sorted(theirs.glob("usr1-*"))
    assert sorted(p.name.split("-")[1] for p in marks) == ["rank0", "rank1", "rank2", "rank3"]
    assert all(p.read_text() == "USR1\n" for p in marks), [p.read_text() for p in marks]
    assert "left to the workers' framework (--requeue-by=framework)" in out
    _check_worker_env(theirs)
