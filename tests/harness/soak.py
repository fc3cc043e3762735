"""Run a training job on the local Slurm under a seeded fault stream; return its analysis.

Shared by ``benchmarks/soak.py`` and ``tests/runtime/test_chaos.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dlrover_hpc.jobdir import events_path, load_master_info
from dlrover_hpc.localslurm.local_slurm import LocalSlurm
from harness.chaos import Chaos, FaultKind, analyze, plan

REPO = Path(__file__).resolve().parent.parent.parent


def _events(job_dir: Path) -> list[dict]:
    path = events_path(job_dir)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def job_state(job: str) -> str:
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=10
    ).stdout
    for word in out.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return "UNKNOWN"


def run_soak(
    cluster: LocalSlurm,
    work: Path,
    *,
    nodes: int,
    nnodes: str,
    duration_s: float,
    every_s: float,
    seed: int,
    step_time: float,
    spares: int = 1,
    kinds: tuple[FaultKind, ...] = tuple(FaultKind),
    heal_s: dict[FaultKind, float] | None = None,
    script_args: tuple[str, ...] = (),
) -> dict:
    """Submit the job, inject the faults while it trains, return the analysis as a dict.
    ``script_args``: more arguments of the training script (``--inprocess``)."""
    os.chmod(work, 0o1777)
    steps_per_s = 1.0 / max(step_time, 0.01)
    steps = int((duration_s + 60) * steps_per_s * 0.9)  # trains a little past the stream
    timing = work / "timing.log"
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    for k in ("DLROVER_HPC_TOKEN", "DLROVER_HPC_MASTER"):
        env.pop(k, None)
    argv = [
        "sbatch",
        "--parsable",
        f"-N{nodes}",
        "-o",
        str(work / "slurm-%j.out"),
        str(REPO / "sbatch" / "train.sbatch"),  # spares: more nodes than --nnodes' maximum
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--max-restarts=5",
        str(REPO / "examples" / "train_flash_ckpt.py"),
        f"--steps={steps}",
        f"--ckpt-dir={work / 'ckpt'}",
        "--save-every=5",
        "--persist-every=50",
        f"--step-time={step_time}",
        f"--timing-log={timing}",
        f"--result={work / 'result.json'}",
        *script_args,
    ]
    job = subprocess.run(
        argv, cwd=work, env=env, capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    job_dir = work / ".dlrover-hpc" / job
    faults = plan(seed, duration_s=duration_s, every_s=every_s, kinds=kinds)
    deadline = time.time() + 180
    while not (timing.exists() and timing.read_text().strip()):  # training started
        if time.time() > deadline or job_state(job) not in ("PENDING", "RUNNING"):
            raise RuntimeError(f"job {job} did not start training: {job_state(job)}")
        time.sleep(0.5)
    master_node = load_master_info(job_dir)["host"]
    chaos = Chaos(cluster, spared=frozenset({master_node}), heal_s=heal_s or {}, job_id=job)
    started = time.time()
    try:
        for fault in faults:
            while time.time() < started + fault.at_s:
                chaos.heal_due()
                time.sleep(0.2)
            if job_state(job) != "RUNNING":  # it ended (or failed) early: nothing to hit
                break
            evs = _events(job_dir)
            rounds = [e for e in evs if e["event"] == "rendezvous_complete"]
            training = rounds[-1]["nodes"] if rounds else []
            workers = {
                e["node"]: e["pids"]
                for e in evs
                if e["event"] == "workers_started" and e["round"] == rounds[-1]["round"]
            }
            chaos.inject(fault, training, workers)
        while time.time() < started + duration_s:
            chaos.heal_due()
            time.sleep(0.2)
    finally:
        chaos.heal_due(all_now=True)
    deadline = time.time() + duration_s + 600
    try:
        while job_state(job) in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED"):
            if time.time() > deadline:
                subprocess.run(["scancel", job], timeout=10, check=False)
                break
            time.sleep(1)
    finally:
        chaos.cleanup()
    lines = [line.split() for line in timing.read_text().splitlines() if line.strip()]
    events = _events(job_dir)
    report = analyze(events, [(float(t), int(s)) for t, s in lines], chaos.log).as_dict()
    began = next(e["time"] for e in events if e["event"] == "job_started")  # analyze needs it too
    report.update(
        job=job,
        job_state=job_state(job),
        # when each hit, in the seconds of the stalls' "start" (from the job's start)
        faults=[
            {"at": round(f["time"] - began, 2), "kind": f["kind"], "node": f["node"]}
            for f in chaos.log
        ],
        max_stall_s=max(s["seconds"] for s in report["stalls"][1:]) if report["stalls"][1:] else 0,
        final_step=steps,
        completed=(work / "result.json").exists(),
    )
    return report
