"""The batch host dies (issue 48, item 5): the node that runs the job script, the master step
and rank 0's agent is killed (all its processes, as a power loss, and set ``state=down``).

- With the template as it is (``--requeue --no-kill``), Slurm 22.05 neither requeues nor ends
  the job: it drops the node and the job keeps RUNNING on the others, without its job script.
  An agent takes over as master, the survivors re-form the round and restore the newest step
  they hold in memory; once the job is done that master ends the allocation (``scancel``),
  since no job script is left to end it.
- Without ``--no-kill``, Slurm requeues the job at once and ends every step on the survivors.
  Their agents keep the node's flash-checkpoint segments; the requeued run (here on the two
  survivors and a node that was idle) restores that step from memory and a peer, not from the
  older step on storage.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from runtime_helpers import TRAIN, events, job_fields, named, sbatch, timing_log, wait_job

from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm
FLASH = TRAIN.parent / "train_flash_ckpt.py"


def _args(work: Path, *, nnodes: str, steps: int) -> list[str]:
    return [
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        str(FLASH),
        f"--steps={steps}",
        f"--ckpt-dir={work / 'ck'}",
        "--save-every=2",  # to memory
        "--persist-every=1000",  # to storage: only the last step
        "--step-time=0.1",
        f"--result={work / 'result.json'}",
        f"--timing-log={work / 'timing.log'}",
    ]


def _kill_batch_host(local_slurm: LocalSlurm, work: Path, job: str, step: int) -> tuple[str, float]:
    wait_for(
        lambda: any(s >= step for _, s in timing_log(work)),
        timeout_s=180,
        what=f"job {job} to reach step {step}",
    )
    fields = job_fields(job)
    batch = fields["BatchHost"]
    assert fields["NodeList"] == "node[1-3]" and batch == "node1", fields
    local_slurm.kill_node(batch)
    return batch, time.time()


def _before(work: Path, at: float) -> int:
    return max(s for t, s in timing_log(work) if t <= at)


def _show(job: str) -> str:
    """``scontrol -o show job``'s line, verbatim (the unit tests' samples)."""
    return subprocess.run(
        ["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=10
    ).stdout.strip()


def _restored(evs: list[dict]) -> list[tuple[str, str, int]]:
    return sorted((e["node"], e["source"], e["step"]) for e in named(evs, "checkpoint_restored"))


def _agent_env(local_slurm: LocalSlurm, node: str, name: str) -> str | None:
    """``name`` in the environment of the job's agent on ``node`` (None: no agent yet)."""
    for pid in local_slurm.netns_pids(node):
        with contextlib.suppress(psutil.Error, OSError):
            proc = psutil.Process(pid)
            if any("dlrover-run" in part for part in proc.cmdline()[:2]):
                return proc.environ().get(name, "")
    return None


def _survivors_took_over_or_xfail(
    local_slurm: LocalSlurm, job_dir: Path, request: pytest.FixtureRequest
) -> None:
    """An agent took over as master (epoch 2 claimed); or Slurm ended the agents' step on the
    survivors too (its srun ran on the dead batch host): seen in 2 of about 10 runs with the
    whole suite side by side, never alone.  Nothing of the job is then left to act, its
    killed agents' segments stay (the next agent's sweep removes them): an expected failure
    of what this test claims, said as such.  Neither within 60 s fails the test."""

    gone = [0]  # looks in a row (1 s apart) that found no agent on either survivor

    def settled() -> str | None:
        if (job_dir / "master-epoch-2").exists():
            return "promoted"
        if all(_agent_env(local_slurm, n, "SLURM_JOB_ID") is None for n in ("node2", "node3")):
            gone[0] += 1
        else:
            gone[0] = 0
        return "agents gone" if gone[0] >= 5 else None

    took_over = wait_for(settled, timeout_s=60, what="an agent to take over", interval_s=1.0)
    print(f"after the batch host's death: {took_over}")
    if took_over == "agents gone":
        request.node.add_marker(pytest.mark.allow_leaks)
        pytest.xfail("Slurm ended the survivors' agent step with the batch host's srun")


@pytest.mark.parametrize("requeue", ["--requeue", "--no-requeue"])
def test_batch_host_crash_with_no_kill_goes_on_from_the_survivors_memory(
    local_slurm: LocalSlurm, shared_tmp: Path, requeue: str, request: pytest.FixtureRequest
) -> None:
    job = sbatch(
        shared_tmp,
        3,
        *_args(shared_tmp, nnodes="2:3", steps=200),
        extra=(requeue,),  # the same either way: Slurm does not requeue a --no-kill job
        master_opts="--replacement-sbatch=off",
    )
    job_dir = shared_tmp / ".dlrover-hpc" / job
    batch, killed_at = _kill_batch_host(local_slurm, shared_tmp, job, 30)
    try:
        kept = job_fields(job)
        print("kept:", _show(job))
        assert kept["JobState"] == "RUNNING" and kept["NodeList"] == "node[2-3]", kept
        _survivors_took_over_or_xfail(local_slurm, job_dir, request)
        fields = wait_job(job, timeout_s=240)
        ended_at = time.time()
    finally:
        local_slurm.restart_node(batch)
    evs = events(job_dir)
    [finished] = named(evs, "job_finished")
    assert finished["exit_code"] == 0, finished
    # No job script is left to end the job: the master (in an agent) ends the allocation.
    assert fields["JobState"] == "CANCELLED", fields
    assert ended_at - finished["time"] < 60, (ended_at, finished)
    [lost] = named(evs, "batch_host_lost")
    assert lost["node"] == batch and lost["exit_code"] == 0, lost
    last = _before(shared_tmp, killed_at)
    restored = _restored([e for e in evs if e["time"] > killed_at])
    assert [src for _, src, _ in restored] == ["memory", "memory"], restored
    step = restored[0][2]
    assert {s for _, _, s in restored} == {step} and abs(step - last) <= 2, (last, restored)
    result = json.loads((shared_tmp / "result.json").read_text())
    assert result["final_step"] == 200 and result["committed"], result
    rounds = [e for e in named(evs, "rendezvous_complete") if e["time"] > killed_at]
    assert sorted(rounds[-1]["nodes"]) == ["node2", "node3"], rounds
    resumed = next(t for t, s in timing_log(shared_tmp) if t > killed_at and s == step + 1)
    print(
        f"batch host crash, --no-kill {requeue}: last step {last} before the kill, restored "
        f"step {step} from memory ({last - step} steps lost), training again "
        f"{resumed - killed_at:.1f} s after the kill, job ended "
        f"{ended_at - finished['time']:.1f} s after job_finished"
    )


def test_batch_host_crash_requeues_and_the_next_run_restores_from_memory(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    job = sbatch(
        shared_tmp,
        3,
        *_args(shared_tmp, nnodes="3:3", steps=150),
        extra=("--no-kill=off",),  # the template's --no-kill off: a lost node requeues the job
        master_opts="--replacement-sbatch=off",
    )
    job_dir = shared_tmp / ".dlrover-hpc" / job
    batch, killed_at = _kill_batch_host(local_slurm, shared_tmp, job, 30)
    last = _before(shared_tmp, killed_at)
    try:
        first = job_fields(job)
        print("requeued:", _show(job))
        assert first["Restarts"] == "1" and first["JobState"] in ("COMPLETING", "PENDING"), first
        pending = wait_for(
            lambda: (f := job_fields(job)).get("JobState") == "PENDING" and f,
            timeout_s=60,
            what="the requeued job to pend",
            interval_s=0.2,
        )
        pended_at = time.time()
        assert pending["Reason"] == "BeginTime", pending  # Slurm holds it ~120 s
        # Lift the hold, as `scontrol update` lets the job's user (measured without: 126 s).
        subprocess.run(
            ["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=10, check=True
        )
        running = wait_for(
            lambda: (f := job_fields(job)).get("JobState") == "RUNNING" and f,
            timeout_s=60,
            what="the requeued job to run",
            interval_s=0.2,
        )
        ran_at = time.time()
        assert running["NodeList"] == "node[2-4]" and running["BatchHost"] == "node2", running
        count = wait_for(
            lambda: _agent_env(local_slurm, "node3", "SLURM_RESTART_COUNT"),
            timeout_s=60,
            what="the requeued run's agent on node3",
        )
        assert count == "1", count
        fields = wait_job(job, timeout_s=240)
    finally:
        local_slurm.restart_node(batch)
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    evs = events(job_dir)
    restored = _restored([e for e in evs if e["time"] > killed_at])
    # node2 and node3 kept their segments; node4 (idle before) got the step from a peer.
    assert [(n, src) for n, src, _ in restored] == [
        ("node2", "memory"),
        ("node3", "memory"),
        ("node4", "peer"),
    ], (restored, out[-4000:])
    step = restored[0][2]
    assert {s for _, _, s in restored} == {step} and abs(step - last) <= 2, (last, restored)
    assert named(evs, "job_finished")[-1]["exit_code"] == 0
    result = json.loads((shared_tmp / "result.json").read_text())
    assert result["final_step"] == 150 and result["start_step"] == step, result
    resumed = next(t for t, s in timing_log(shared_tmp) if t > killed_at and s == step + 1)
    print(
        f"batch host crash, requeue: last step {last} before the kill, requeued at once "
        f"(Restarts=1), pending after {pended_at - killed_at:.1f} s, running again "
        f"{ran_at - pended_at:.1f} s after the hold was lifted, on {running['NodeList']}, "
        f"restored step {step} from memory+peer ({last - step} steps lost), training again "
        f"{resumed - ran_at:.1f} s after the requeued run started"
    )
