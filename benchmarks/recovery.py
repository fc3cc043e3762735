"""Recovery time from a SIGKILLed worker to the next completed training step.

dlrover-run --standalone against torchrun (c10d rendezvous) on the same job, same run:
examples/train.py with 2 gloo workers; rank 1 SIGKILLs itself once at --fail-at-step.
Recovery = (rank 0's first completed step after the restart) - (the kill).  Prints one JSON
line.  torchrun 2.13 with gloo does not recover here (its restarted workers dial the previous
attempt's ports); then the figure is the time until it gave up.

    python benchmarks/recovery.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TRAIN = REPO / "examples" / "train.py"
HANG_S = 120.0  # a run still going after this long hung


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one(launcher: str, work: Path, *, steps: int, fail_at: int) -> dict:
    ckpt = work / "ckpt"
    ckpt.mkdir()
    timing = work / "timing.txt"
    train = [
        str(TRAIN),
        f"--steps={steps}",
        f"--ckpt-dir={ckpt}",
        "--ckpt-every=5",
        f"--fail-at-step={fail_at}",
        "--fail-rank=1",
        f"--timing-log={timing}",
        "--step-time=0.05",
    ]
    if launcher == "dlrover-run":
        argv = [
            str(BIN / "dlrover-run"),
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=3",
            f"--job-dir={work / 'job'}",
            *train,
        ]
    else:
        argv = [
            str(BIN / "torchrun"),
            "--nnodes=1",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
            "--max-restarts=3",
            *train,
        ]
    t0 = time.time()
    proc = subprocess.Popen(
        argv, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        returncode: int | None = proc.wait(timeout=HANG_S)
    except subprocess.TimeoutExpired:  # torchrun's gloo restarts can hang: count it as such
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        returncode = None
    end = time.time()
    kill_at = float((ckpt / ".failed-once-1").read_text())
    lines = timing.read_text().splitlines() if timing.exists() else []
    after = [float(line.split()[0]) for line in lines if int(line.split()[2]) > 0]
    recovered = returncode == 0 and bool(after)
    return {
        "exit_code": returncode,
        "hung": returncode is None,
        "recovered": recovered,
        "recovery_s": round(after[0] - kill_at, 3) if after else None,
        "gave_up_after_s": None if recovered else round(end - kill_at, 3),
        "total_s": round(end - t0, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fail-at-step", type=int, default=12)
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"dlrover-run": [], "torchrun": []}
    for _ in range(args.repeats):
        for launcher in runs:  # interleaved, so both see the same machine noise
            with tempfile.TemporaryDirectory() as d:
                runs[launcher].append(
                    _one(launcher, Path(d), steps=args.steps, fail_at=args.fail_at_step)
                )
    ours = [r["recovery_s"] for r in runs["dlrover-run"] if r["recovered"]]
    theirs = [r["recovery_s"] for r in runs["torchrun"] if r["recovered"]]
    theirs_fail = [r["gave_up_after_s"] for r in runs["torchrun"] if not r["recovered"]]
    summary = {
        "bench": "recovery",
        "dlrover_run_recovered": f"{len(ours)}/{args.repeats}",
        "dlrover_run_recovery_s_median": statistics.median(ours) if ours else None,
        "torchrun_recovered": f"{len(theirs)}/{args.repeats}",
        "torchrun_recovery_s_median": statistics.median(theirs) if theirs else None,
        "torchrun_gave_up_after_s_median": statistics.median(theirs_fail) if theirs_fail else None,
        "ratio_to_torchrun": round(statistics.median(ours) / statistics.median(theirs), 3)
        if ours and theirs
        else None,
        "goal_ratio": 0.5,
        "runs": runs,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
