"""Latency of every Slurm query and command the master makes (issue 31, item 1).

The master talks to Slurm through ``dlrover_hpc.slurm.commands`` only, each call a fork of one of
Slurm's command-line tools. This benchmark brings up the local Slurm (cluster ``--index``, 4
nodes), holds a 2-node job, and times each call the master makes, ``--repeat`` times:

- ``time_left`` (``squeue -o %L``): every 60 s while a job runs (the time-limit watch);
- ``job_nodes`` + ``node_states`` (``squeue -o %N``, ``sinfo -n``): every second, only while a
  node of the job is lost (the relaunch planner);
- ``show_nodes`` (``scontrol -o show node HOSTLIST``, every node of the cluster): every 5 s while
  the job runs (the live node states, issue 48); and its parse at 4,096 nodes (the captured
  lines, renamed), which runs in the master's process;
- ``show_job`` (``scontrol show job``): at a stop signal (cancelled or not?) and a continuation;
- ``show_node``; ``drain_node`` (``scontrol update State=DRAIN``, a node then resumed); ``submit``
  (``sbatch --hold``, then cancelled): once per faulty node or replacement.

The baseline, in the same run: forking ``/bin/true`` through the same runner (what a call costs
before Slurm answers). pyslurm, which would skip the fork, has no release for the local Slurm
22.05 on the package index (README, "Slurm: commands, not pyslurm").

Prints one JSON line: per call the median and p90 in milliseconds and the ratio of its median to
the baseline's.

    python benchmarks/slurm_calls.py --repeat 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dlrover_hpc.localslurm import LocalSlurm, LocalSlurmConfig  # noqa: E402
from dlrover_hpc.slurm import commands as slurm  # noqa: E402
from dlrover_hpc.slurm.parse import parse_show_nodes  # noqa: E402

CAPTURED = REPO / "tests" / "data" / "slurm" / "show_nodes_drained.txt"


def _timed(call: Callable[[], object], repeat: int, after: Callable[[], object] | None = None):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        if after is not None:
            after()
    times.sort()
    return {
        "median_ms": round(statistics.median(times) * 1000, 2),
        "p90_ms": round(times[int(0.9 * (len(times) - 1))] * 1000, 2),
        "n": repeat,
    }


def _scontrol(*args: str) -> None:
    subprocess.run(["scontrol", *args], check=True, capture_output=True, timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--index", type=int, default=0, help="local Slurm cluster index")
    args = parser.parse_args()

    cluster = LocalSlurm(LocalSlurmConfig(nodes=4, index=args.index))
    cluster.up()
    os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
    job = slurm.submit(
        ["sbatch", "--parsable", "-o", "/dev/null", "-N2", "-w", "node[1-2]", "--wrap", "sleep 600"]
    )
    held: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while slurm.show_job(job).get("JobState") != "RUNNING":
            if time.monotonic() > deadline:
                raise SystemExit(f"job {job} did not start in 60 s")
            time.sleep(0.2)
        nodes = slurm.job_nodes(job)

        def submit_held() -> None:
            held.append(
                slurm.submit(
                    ["sbatch", "--parsable", "-o", "/dev/null", "--hold", "--wrap", "true"]
                )
            )

        calls = {
            "baseline_fork_true": lambda: slurm.run_command(["true"], timeout_s=10),
            "time_left (squeue %L)": lambda: slurm.time_left(job),
            "job_nodes (squeue %N)": lambda: slurm.job_nodes(job),
            "node_states (sinfo)": lambda: slurm.node_states(nodes),
            "show_job (scontrol)": lambda: slurm.show_job(job),
            "show_node (scontrol)": lambda: slurm.show_node("node3"),
            "show_nodes (scontrol, 4 nodes)": lambda: slurm.show_nodes(
                ["node1", "node2", "node3", "node4"]
            ),
        }
        figures = {name: _timed(call, args.repeat) for name, call in calls.items()}
        figures["drain_node (scontrol update)"] = _timed(
            lambda: slurm.drain_node("node4", reason="benchmark"),
            max(args.repeat // 3, 3),
            after=lambda: _scontrol("update", "NodeName=node4", "State=RESUME"),
        )
        figures["submit (sbatch --hold)"] = _timed(submit_held, max(args.repeat // 3, 3))
    finally:
        subprocess.run(["scancel", job, *held], check=False, timeout=30)
    lines = CAPTURED.read_text().splitlines()
    big = "\n".join(
        lines[i % len(lines)].replace(f"node{i % len(lines) + 1} ", f"node{i + 1} ", 1)
        for i in range(4096)
    )
    parsed = len(parse_show_nodes(big))
    figures["parse_show_nodes (4,096 nodes, in the master)"] = {
        **_timed(lambda: parse_show_nodes(big), args.repeat),
        "bytes": len(big),
        "nodes": parsed,
    }
    base = figures["baseline_fork_true"]["median_ms"]
    for fig in figures.values():
        fig["x_baseline"] = round(fig["median_ms"] / base, 1) if base else None
    polled = {
        "time_left (squeue %L)": "every 60 s while the job runs",
        "job_nodes + node_states": "every 1 s while a node of the job is lost",
        "show_nodes": "every 5 s while the job runs",
    }
    print(
        json.dumps(
            {
                "benchmark": "slurm_calls",
                "slurm": subprocess.run(
                    ["sinfo", "--version"], capture_output=True, text=True, check=False
                ).stdout.strip(),
                "backend": "cli",
                "calls": figures,
                "master_polls": polled,
            }
        )
    )


if __name__ == "__main__":
    main()
