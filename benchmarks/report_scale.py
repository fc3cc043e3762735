"""The goodput report at scale: a synthetic event log of a long job on many nodes.

The log looks like the master writes it: 8 ranks per node save every ``--save-every`` seconds
(one ``checkpoint_saved`` per rank), the job's step every 5 s, a fault every ``--fault-every``
seconds (a worker failure or a node loss and its replacement, then a new round).  Measured:

* ``report_s``: ``dlrover-hpc report``'s work (read, analyse with lanes), against the baseline
  ``parse_s``: only reading and JSON-decoding the same file (the least any report must do);
* ``plot_s``: the timeline PNG;
* ``fold_us_per_event`` and ``scrape_s``: the master's running account (one event folded in,
  and one metrics scrape's report), which must stay far below the event rate and the scrape
  interval.

Prints one JSON line.  Usage: python benchmarks/report_scale.py [--nodes 256] [--hours 8]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dlrover_hpc.report.analysis import Analysis, analyze, read_events
from dlrover_hpc.report.plot import plot


def synthetic(nodes: int, hours: float, save_every: float, fault_every: float) -> list[dict]:
    rng = random.Random(1)
    names = [f"node{i:04d}" for i in range(1, nodes + 1)]
    spare = [f"spare{i:03d}" for i in range(1, 1 + max(2, nodes // 32))]
    t, end, step, rnd = 0.0, hours * 3600, 0, 0
    out: list[dict[str, Any]] = [{"time": t, "event": "job_started", "job_id": "bench"}]
    out += [{"time": 1.0, "event": "node_joined", "node": n, "agent": n} for n in names + spare]
    members = list(names)
    while t < end:
        rnd += 1
        t += 3.0
        out.append({"time": t, "event": "rendezvous_complete", "round": rnd, "nodes": members})
        t += 5.0
        stop = min(end, t + rng.expovariate(1 / fault_every))
        next_save = t + save_every
        while t < stop:
            t += 5.0
            step += 33
            out.append(
                {"time": t, "event": "training_progress", "round": rnd, "step": step, "at": t}
            )
            if t >= next_save:
                next_save += save_every
                for n_i, n in enumerate(members):
                    for r in range(8):
                        out.append(
                            {
                                "time": t,
                                "event": "checkpoint_saved",
                                "node": n,
                                "rank": n_i * 8 + r,
                                "step": step,
                                "blocking_s": 0.05,
                            }
                        )
                out.append(
                    {
                        "time": t + 2,
                        "event": "checkpoint_persisted",
                        "step": step,
                        "persist_s": 2.0,
                        "committed": True,
                    }
                )
        if t >= end:
            break
        victim = rng.choice(members)
        if rng.random() < 0.5:
            out.append(
                {
                    "time": t,
                    "event": "worker_failed",
                    "node": victim,
                    "rank": 0,
                    "classification": "software",
                    "signal": "SIGKILL",
                }
            )
        else:
            out.append({"time": t, "event": "node_lost", "node": victim, "reason": "bench"})
            members = [spare.pop() if n == victim and spare else n for n in members]
        step -= 10  # rolled back to the newest save
    out.append({"time": t + 1, "event": "job_finished", "exit_code": 0})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=256)
    p.add_argument("--hours", type=float, default=8.0)
    p.add_argument("--save-every", type=float, default=300.0)
    p.add_argument("--fault-every", type=float, default=1800.0)
    args = p.parse_args()
    events = synthetic(args.nodes, args.hours, args.save_every, args.fault_every)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        t0 = time.perf_counter()
        parsed = [json.loads(line) for line in path.read_text().splitlines()]
        parse_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = analyze(read_events(path))
        report_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        summary = plot(report, Path(tmp) / "timeline.png")
        plot_s = time.perf_counter() - t0
    folded = Analysis()
    t0 = time.perf_counter()
    for e in parsed:
        folded.add(e)
    fold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    folded.report(now=events[-1]["time"], lanes=False)
    scrape_s = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "nodes": args.nodes,
                "hours": args.hours,
                "events": len(events),
                "mb": round(sum(len(json.dumps(e)) + 1 for e in events) / 1e6, 1),
                "rounds": report.rounds,
                "goodput": report.goodput,
                "parse_s": round(parse_s, 3),
                "report_s": round(report_s, 3),
                "report_vs_parse": round(report_s / parse_s, 2),
                "plot_s": round(plot_s, 3),
                "plot_px": [summary.width_px, summary.height_px],
                "fold_us_per_event": round(fold_s / len(parsed) * 1e6, 2),
                "scrape_s": round(scrape_s, 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
