"""Shared by the runtime tests: run a training job, read its events."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from dlrover_hpc.localslurm import wait_for
from dlrover_hpc.slurm.parse import parse_oneliner

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train.py"
BIN = Path(sys.executable).parent


def run_env() -> dict[str, str]:
    """Our entry points on PATH for Slurm steps (sbatch exports the environment)."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env.pop("DLROVER_HPC_TOKEN", None)
    env.pop("DLROVER_HPC_MASTER", None)
    return env


def events(job_dir: Path) -> list[dict]:
    path = job_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def jsonl_records(log_dir: Path, pattern: str = "rank*.jsonl") -> list[dict]:
    """Every JSON line of the files ``pattern`` names in ``log_dir`` (a line torn by a kill
    is skipped)."""
    out = []
    for path in sorted(log_dir.glob(pattern)):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def timing_log(work: Path) -> list[tuple[float, int]]:
    """``(wall time, step)`` of each step rank 0 wrote to ``work/timing.log`` (the example's
    ``--timing-log``); a line torn by a kill is skipped."""
    log = work / "timing.log"
    if not log.exists():
        return []
    rows = [line.split() for line in log.read_text().splitlines()]
    return [(float(r[0]), int(r[1])) for r in rows if len(r) == 2]


def named(evs: list[dict], name: str) -> list[dict]:
    return [e for e in evs if e["event"] == name]


def sbatch(
    workdir: Path,
    nodes: int,
    *args: str,
    extra: tuple[str, ...] = (),
    master_opts: str = "",
    template: str = "train.sbatch",
    env: dict[str, str] | None = None,
) -> str:
    env = {**run_env(), **(env or {})}
    if master_opts:
        env["DLROVER_HPC_MASTER_OPTS"] = master_opts
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"-N{nodes}",
            "-o",
            str(workdir / "slurm-%j.out"),
            *extra,
            str(REPO / "sbatch" / template),
            *args,
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return out.strip().split(";")[0]


def job_fields(job: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=10
    ).stdout
    return parse_oneliner(out)


def wait_job(job: str, *, timeout_s: float) -> dict[str, str]:
    def ended() -> dict[str, str]:
        f = job_fields(job)
        return f if f.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") else {}

    try:
        return wait_for(ended, timeout_s=timeout_s, what=f"job {job} to end", interval_s=0.5)
    except TimeoutError:
        subprocess.run(["scancel", job], timeout=10)
        wait_for(ended, timeout_s=30, what=f"job {job} to be cancelled", interval_s=0.5)
        raise


def wait_training(work: Path, job: str, step: int) -> None:
    """Until the job's output (``slurm-JOB.out`` in ``work``) shows rank 0 past ``step``."""
    out = work / f"slurm-{job}.out"
    wait_for(
        lambda: out.exists() and f"step {step} loss" in out.read_text(),
        timeout_s=120,
        what=f"job {job} to reach step {step}",
        interval_s=0.3,
    )
