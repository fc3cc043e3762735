"""The crash-loop guard on the real local Slurm (issue 48): a script that segfaults at the same
step in every attempt ends with the crash-loop exit code and the failure named, long before a
high ``--max-restarts`` would end it; and a requeue of that job never trains again."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from runtime_helpers import BIN, events, job_fields, named, sbatch, wait_job

from dlrover_hpc.localslurm import LocalSlurm, wait_for
from dlrover_hpc.master.crash_loop import EXIT_CODE

pytestmark = pytest.mark.slurm

#: DDP on gloo; rank 0 segfaults after step 5 of every attempt (no checkpoint: each attempt
#: starts from step 0 and gets exactly as far).
SCRIPT = """\
import os, signal, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 1000):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.05)
    if rank == 0:
        print(f"step {step}", flush=True)
    if step == 5 and rank == 0:
        os.kill(os.getpid(), signal.SIGSEGV)
dist.destroy_process_group()
"""


def test_a_segfault_at_the_same_step_in_every_attempt_ends_as_a_crash_loop(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    script = shared_tmp / "segv.py"
    script.write_text(SCRIPT)
    began = time.time()
    job = sbatch(
        shared_tmp,
        2,
        "--nnodes=2:2",
        "--nproc-per-node=1",
        "--max-restarts=50",  # the budget is not what ends it
        str(script),
        extra=("-w", "node[1-2]"),
        master_opts="--replacement-sbatch=off",
    )
    fields = wait_job(job, timeout_s=600)
    ended = time.time()
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "FAILED", out[-4000:]
    assert fields["ExitCode"] == f"{EXIT_CODE}:0", (fields["ExitCode"], out[-4000:])
    job_dir = shared_tmp / ".dlrover-hpc" / job
    evs = events(job_dir)
    [loop] = named(evs, "crash_loop")
    assert loop["rounds"] == 3 and loop["rank"] == 0, loop
    assert loop["classification"] == "software", loop
    assert "SIGSEGV" in loop["error"], loop
    [finished] = named(evs, "job_finished")
    assert finished["exit_code"] == EXIT_CODE
    repeated = finished["repeated_failure"]
    assert (repeated["rank"], repeated["classification"]) == (0, "software")
    assert repeated["error"] == loop["error"]
    assert "crash loop: 3 rounds in a row" in finished["reason"], finished
    assert finished["restart_count"] < 50
    rounds = named(evs, "rendezvous_complete")
    wall = finished["time"] - named(evs, "job_started")[0]["time"]
    print(
        f"crash loop: job ended {ended - began:.1f} s after sbatch ({wall:.1f} s master wall), "
        f"{len(rounds)} rounds, {finished['restart_count']} restarts charged"
    )
    assert ended - began < 600
    assert len(rounds) == 4  # round 1 reached step 5 from nothing; 2-4 got no further

    # Requeued after it ended (an admin, or Slurm for a node failure): the template sees the
    # crash loop's verdict and exits with it at once, without training again.
    # (A batch job started again within the second its credential was revoked at its end is
    # killed by slurmd, "Job credential revoked": begin a few seconds on, not at once.)
    subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now+3"], timeout=30)
    wait_for(
        lambda: job_fields(job).get("Restarts", "0") != "0",
        timeout_s=60,
        what=f"job {job} requeued",
        interval_s=0.5,
    )
    again = wait_job(job, timeout_s=180)
    ctld = (local_slurm.config.state_dir / "log" / "slurmctld.log").read_text().splitlines()
    seen = "\n".join(line for line in ctld if job in line)[-3000:]
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    assert again["JobState"] == "FAILED" and again["ExitCode"] == f"{EXIT_CODE}:0", (
        again["ExitCode"],
        seen,
        out[-2000:],
    )
    assert len(named(events(job_dir), "job_started")) == 1, "a requeued crash loop trained again"


def test_standalone_crash_loop_exits_3_with_the_failure_named(tmp_path: Path) -> None:
    """No Slurm: rank 0 exits 3 at start in every attempt (no step, so round 1 makes no
    progress either); --max-restarts=9 would allow 9 more."""
    proc = _standalone(
        tmp_path,
        "import os, sys\n"
        "if os.environ['LOCAL_RANK'] == '0':\n"
        "    raise RuntimeError('bad config: no such dataset /data/x')\n",
        "--nproc-per-node=2",
        "--max-restarts=9",
    )
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    evs = events(tmp_path / "job")
    [loop] = named(evs, "crash_loop")
    assert (loop["rounds"], loop["rank"], loop["classification"]) == (3, 0, "software"), loop
    assert "RuntimeError: bad config: no such dataset /data/x" in loop["error"], loop
    assert len(named(evs, "rendezvous_complete")) == 3
    assert "crash loop: 3 rounds in a row (rounds 1-3)" in named(evs, "job_finished")[-1]["reason"]


@pytest.mark.parametrize(("rounds", "code", "started"), [("2", EXIT_CODE, 2), ("0", 1, 4)])
def test_dlrover_run_sets_the_guard_of_its_in_process_master(
    tmp_path: Path, rounds: str, code: int, started: int
) -> None:
    """``dlrover-run --crash-loop-rounds`` reaches a standalone master: 2 stops the loop after
    two rounds; 0 turns the guard off, and the restart budget (3) ends the job as before."""
    proc = _standalone(
        tmp_path,
        "raise RuntimeError('bad config: no such dataset /data/x')\n",
        "--nproc-per-node=1",
        "--max-restarts=3",
        f"--crash-loop-rounds={rounds}",
    )
    assert proc.returncode == code, proc.stderr[-3000:]
    evs = events(tmp_path / "job")
    assert len(named(evs, "crash_loop")) == (1 if code == EXIT_CODE else 0), evs
    assert len(named(evs, "rendezvous_complete")) == started, named(evs, "rendezvous_complete")


def _standalone(tmp_path: Path, script: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """``dlrover-run --standalone FLAGS bad.py`` (``script``), its job directory under
    ``tmp_path/job``."""
    bad = tmp_path / "bad.py"
    bad.write_text(script)
    return subprocess.run(
        [
            str(BIN / "dlrover-run"),
            "--standalone",
            *flags,
            f"--job-dir={tmp_path / 'job'}",
            str(bad),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
