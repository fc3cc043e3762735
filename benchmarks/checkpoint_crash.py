"""Crash injection, 200 trials: SIGKILL the saver at random points while it persists.

Each trial saves a new step of a two-rank job into shared memory, runs a fresh saver process to
persist it, and kills that process either at a random fault point (after a write, an fsync, a
rename, the commit record, the tracker, a retention delete, ...) or after a random delay.
After every trial the job is "restarted": each rank loads from storage only and must get the
newest committed step, with every value exactly as that step saved it.  Prints JSON; exits 1 on
any violation.

    nice python benchmarks/checkpoint_crash.py --trials 200
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dlrover_hpc.checkpoint.crash_trials import run_trials  # noqa: E402
from dlrover_hpc.checkpoint.testing import remove_job_segments  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timed-every", type=int, default=4, help="every Nth kill is by timer")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    job = f"crash-{uuid.uuid4().hex[:8]}"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.monotonic()
    error = None
    trials = []
    with tempfile.TemporaryDirectory(prefix="dlrover-hpc-crash-") as root:
        try:
            trials = run_trials(
                Path(root), trials=args.trials, seed=seed, job_id=job, timed_every=args.timed_every
            )
        except AssertionError as exc:  # a torn, mixed or stale checkpoint was loaded
            error = str(exc)
        finally:
            leaked = remove_job_segments(job)
    outcomes = collections.Counter(
        ("completed" if t.exit_code == 0 else "killed")
        + ("+committed" if t.loaded == t.step else "+previous")
        for t in trials
    )
    result = {
        "trials": len(trials),
        "seed": seed,
        "seconds": round(time.monotonic() - t0, 1),
        "outcomes": dict(outcomes),
        "killed_by_timer": sum(1 for t in trials if t.kill_after_s is not None),
        "violations": 0 if error is None else 1,
        "error": error,
        "leaked_segments": leaked,
        "always_newest_committed": error is None
        and all(t.loaded == t.newest_record for t in trials),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if error is None and not leaked and len(trials) == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
