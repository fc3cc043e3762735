"""Goodput under a stream of faults: a DDP job with flash checkpoints on the local Slurm (root).

A 5-node allocation trains with ``--nnodes=3:4`` (4 train, 1 hot spare) while a seeded stream
of faults hits the job's nodes every ~50 s: SIGKILL of a worker, of an agent, of slurmd; a
node's link cut for 30 s; a node crash (back after 20 s); an admin drain (resumed after 60 s);
and the faults that crash nothing (issue 25): a worker SIGSTOPped for good (``worker_hang``),
the node's first training process run a quarter of the time for 120 s,
whichever process that is after a restart (``slow_node``), a node's link rate-limited for
120 s (``link_slow``).  The job runs with the default flags.  ``--kinds`` picks a subset.
The master's node is spared (it has no stand-by yet).  Prints one JSON line: goodput (distinct
steps x ideal step time / wall; the ideal step time is the median interval between
consecutive steps of the same run, the baseline measured in the same job), each stall with its
cause, lost steps beyond the newest memory checkpoint, restores by source; and beside it the
goodput and lost time by cause that ``dlrover-hpc report`` finds in the job's event log alone.

    python benchmarks/soak.py --duration 600 --every 50 --seed 1

The suite runs a short version (tests/runtime/test_chaos.py).  Brings a 5-node local Slurm up
(a different one that is up is taken down first) and down again at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the tests' harness: chaos, soaks, ports

from harness.chaos import FaultKind  # noqa: E402
from harness.isolation import private_mounts, worker_index  # noqa: E402
from harness.soak import run_soak  # noqa: E402

from dlrover_hpc.localslurm import LocalSlurm, LocalSlurmConfig  # noqa: E402
from dlrover_hpc.report.analysis import analyze, read_events  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of faults")
    p.add_argument("--every", type=float, default=50.0, help="seconds between faults (+-20 %%)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--nnodes", default="3:4")
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument(
        "--inprocess",
        action="store_true",
        help="the script opts in to in-process recovery (dlrover_hpc.trainer.inprocess)",
    )
    p.add_argument(
        "--kinds",
        default=",".join(FaultKind),
        help=f"comma-separated fault kinds (default: all of {', '.join(FaultKind)})",
    )
    args = p.parse_args()
    index = worker_index()  # PYTEST_XDIST_WORKER=gwK: cluster K+1, beside the others' (0: alone)
    if index:
        private_mounts()
    cluster = LocalSlurm(LocalSlurmConfig(nodes=args.nodes, index=index))
    os.environ["SLURM_CONF"] = str(cluster.config.slurm_conf)
    state = cluster._load_state() or {}
    if cluster.is_up() and state.get("nodes") != cluster.config.node_names():
        LocalSlurm(LocalSlurmConfig(index=index)).down()
    cluster.up()
    work = Path(tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
    try:
        report = run_soak(
            cluster,
            work,
            nodes=args.nodes,
            nnodes=args.nnodes,
            duration_s=args.duration,
            every_s=args.every,
            seed=args.seed,
            step_time=args.step_time,
            kinds=tuple(FaultKind(k) for k in args.kinds.split(",")),
            script_args=("--inprocess",) if args.inprocess else (),
        )
        report["inprocess"] = args.inprocess
    finally:
        cluster.down()
    # The same goodput from the event log alone (dlrover-hpc report), beside rank 0's timing.
    events = work / ".dlrover-hpc" / str(report["job"]) / "events.jsonl"
    if events.exists():
        logged = analyze(read_events(events))
        report["report_goodput"] = logged.goodput
        report["report_lost_s"] = {str(k): v for k, v in logged.lost_s.items() if v}
    report["work"] = str(work) if args.keep else None
    print(json.dumps(report))


if __name__ == "__main__":
    main()
