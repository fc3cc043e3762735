"""No false alarm from long phases that are not hangs (issue 25, item 3), at full size.

``examples/train_long_phases.py`` under ``dlrover-run --standalone`` (2 workers, default
flags): a 60 s first step, a 90 s evaluation every 100 steps, a data loader whose first batch
takes 30 s, and a 1 GiB flash checkpoint persisted on exit; every step is 0.05 s, so the bound
learned from the step times is 30 s.  Prints one JSON line: the wall time, the steps and
evaluations done, and the count of ``hang_detected``, ``straggler_detected`` and
``workers_restarted`` events (all must be 0).

    python benchmarks/false_alarms.py                 # about 8 minutes
    python benchmarks/false_alarms.py --epochs 2      # shorter
    python benchmarks/false_alarms.py --epochs 2 --unmarked   # issue 45's: an unmarked busy eval
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--persist-mb", type=int, default=1024)
    p.add_argument(
        "--unmarked",
        action="store_true",
        help="issue 45's job instead: a 40 s first step, a 90 s evaluation at step 100 under "
        "no_grad() without model.eval() (busy CPU), a 30 s first batch, a 256 MiB persist",
    )
    args = p.parse_args()
    first_s, evals = "60", ["--eval-every=100", "--eval-s=90"]
    if args.unmarked:
        first_s, evals = "40", ["--eval-every=0", "--busy-eval-at=100", "--busy-eval-s=90"]
        args.persist_mb = 256
    with tempfile.TemporaryDirectory(prefix="false-alarms-", dir="/tmp") as tmp:
        work = Path(tmp)
        job_dir = work / "job"
        t0 = time.time()
        proc = subprocess.run(
            [
                str(Path(sys.executable).parent / "dlrover-run"),
                "--standalone",
                "--nproc-per-node=2",
                f"--job-dir={job_dir}",
                "--rdzv-id=false-alarms",
                str(REPO / "examples" / "train_long_phases.py"),
                f"--epochs={args.epochs}",
                "--epoch-steps=100",
                f"--first-step-s={first_s}",
                *evals,
                "--loader-first-s=30",
                "--section-s=0",
                f"--persist-mb={args.persist_mb}",
                f"--ckpt-dir={work / 'ckpt'}",
                f"--result={work / 'result.json'}",
            ],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=3600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        wall = time.time() - t0
        path = job_dir / "events.jsonl"
        evs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        result_file = work / "result.json"
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        counts = {
            name: sum(1 for e in evs if e["event"] == name)
            for name in (
                "hang_detected",
                "straggler_detected",
                "workers_restarted",
                "exit_hang",
                "progress_stalled",
            )
        }
        alarms = {k: v for k, v in counts.items() if k != "progress_stalled"}
        # what a restart came from: the failures and the rounds' reasons, as the log says
        why = [
            {
                k: e.get(k)
                for k in ("event", "reason", "rank", "exit_code", "signal", "classification")
                if e.get(k) is not None
            }
            for e in evs
            if e["event"] in ("worker_failed", "workers_restarted", "hang_detected", "node_lost")
        ]
        print(
            json.dumps(
                {
                    "exit_code": proc.returncode,
                    "wall_s": round(wall, 1),
                    **result,
                    **counts,
                    "clean": proc.returncode == 0 and not any(alarms.values()),
                    "persist_mb": args.persist_mb,
                    "restarts_from": why,
                }
            )
        )
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])


if __name__ == "__main__":
    main()
