"""How soon a slow node and a slow link are found (fail-slow, issue 50), on the local Slurm (root).

One 4-node DDP job (``examples/train_flash_ckpt.py``, 0.1 s of sleep per step, a memory
save every 5 steps; default flags: ``--straggler-factor 2``, no spare, so a straggler is
reported and not swapped) trains healthy for ``--healthy`` seconds, then takes three faults
one after the other, each on another node and healed before the next:

- ``half``: the node's training process runs 0.45 s of every second (SIGSTOP/SIGCONT, as the
  soak's ``slow_node``): the job at about 1/2 speed;
- ``two_thirds``: 0.62 s of every second: about 2/3 speed;
- ``link``: the node's link rate-limited (``tc tbf``, the soak's 256 kbit: every packet
  acknowledged, the job's steps 3-4x longer).

Prints one JSON line: per fault the seconds from its onset to ``straggler_detected`` naming
that node (``found_s``, null if not within ``--wait``), the cause, what it was measured on,
the speed the job ran at meanwhile (the median step before over the median step during); and
the alarms that named no faulty node (``false_alarms``; the healthy phase included).

    python benchmarks/fail_slow.py                      # about 4 minutes
    PYTEST_XDIST_WORKER=gw6 python benchmarks/fail_slow.py --faults half,link   # cluster 7
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the tests' harness

from harness.chaos import LINK_SLOW_RATE, throttle, training_pids  # noqa: E402
from harness.isolation import private_mounts, worker_index  # noqa: E402

from dlrover_hpc.localslurm import LocalSlurm, LocalSlurmConfig  # noqa: E402

PERIOD_S = 1.0
#: fault -> the share of each period the node's training process runs (None: the link)
FAULTS = {"half": 0.45, "two_thirds": 0.62, "link": None}


def _events(job_dir: Path) -> list[dict]:
    path = job_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _steps(timing: Path) -> list[tuple[float, int]]:
    rows = [x.split() for x in timing.read_text().splitlines()] if timing.exists() else []
    return [(float(r[0]), int(r[1])) for r in rows if len(r) == 2]


def _step_s(steps: list[tuple[float, int]], begin: float, end: float) -> float:
    """The mean step time from ``begin`` to ``end`` (a throttled node's steps are uneven)."""
    inside = [s for s in steps if begin <= s[0] <= end]
    if len(inside) < 2 or inside[-1][1] <= inside[0][1]:
        return 0.0
    return (inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--healthy", type=float, default=60.0, help="seconds before the first fault")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, in order")
    p.add_argument("--hold", type=float, default=25.0, help="seconds each fault lasts")
    p.add_argument("--gap", type=float, default=15.0, help="seconds between faults")
    p.add_argument("--wait", type=float, default=25.0, help="longest wait for a verdict")
    p.add_argument("--step-time", type=float, default=0.1)
    args = p.parse_args()
    if worker_index():  # a cluster of its own beside the others', as a test worker's
        private_mounts()
    cfg = LocalSlurmConfig(nodes=4, index=worker_index())
    os.environ["SLURM_CONF"] = str(cfg.slurm_conf)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cluster = LocalSlurm(cfg)
    cluster.up()
    work = Path(tempfile.mkdtemp(prefix="fail-slow-", dir="/tmp"))
    os.chmod(work, 0o1777)
    env = {
        k: v for k, v in os.environ.items() if k not in ("DLROVER_HPC_TOKEN", "DLROVER_HPC_MASTER")
    }
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    timing = work / "timing.log"
    job = (
        subprocess.run(
            [
                "sbatch",
                "--parsable",
                "-N4",
                "-w",
                "node[1-4]",
                "-o",
                str(work / "slurm-%j.out"),
                str(REPO / "sbatch" / "train.sbatch"),
                "--nnodes=4",
                "--nproc-per-node=1",
                str(REPO / "examples" / "train_flash_ckpt.py"),
                "--steps=1000000",
                f"--ckpt-dir={work / 'ckpt'}",
                "--save-every=5",
                "--persist-every=50",
                f"--step-time={args.step_time}",
                f"--timing-log={timing}",
            ],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        .stdout.strip()
        .split(";")[0]
    )
    job_dir = work / ".dlrover-hpc" / job
    results, began = [], 0.0
    try:
        deadline = time.time() + 240
        while len(_steps(timing)) < 20:
            if time.time() > deadline:
                raise SystemExit(f"job {job} did not train: {work}")
            time.sleep(0.5)
        began = time.time()
        time.sleep(args.healthy)
        nodes = iter(["node2", "node3", "node4", "node2", "node3", "node4"])
        for kind in args.faults.split(","):
            node, share = next(nodes), FAULTS[kind]
            stop = threading.Event()
            onset = time.time()
            if share is None:
                cluster.slow_link(node, rate=LINK_SLOW_RATE)
            else:
                pids: list[int] = []
                while not pids and time.time() < onset + 10:
                    pids = training_pids(cluster, job, node)
                    time.sleep(0 if pids else 0.5)
                if not pids:
                    raise SystemExit(f"no training process on {node}: {work}")
                onset, pid = time.time(), pids[0]
                threading.Thread(
                    target=throttle,
                    args=(pid, lambda: None, stop),  # a restart is no part of it
                    kwargs={"on_s": share * PERIOD_S, "period_s": PERIOD_S},
                    daemon=True,
                ).start()
            found = None
            while time.time() < onset + max(args.hold, args.wait) and found is None:
                time.sleep(0.2)
                found = next(
                    (
                        e
                        for e in _events(job_dir)
                        if e["event"] == "straggler_detected"
                        and e["node"] == node
                        and e["time"] >= onset
                    ),
                    None,
                )
            time.sleep(max(0.0, onset + args.hold - time.time()))
            healed = time.time()
            if share is None:
                cluster.unslow_link(node)
            stop.set()
            steps = _steps(timing)
            before = _step_s(steps, onset - args.gap + 2, onset)
            during = _step_s(steps, onset + 3, healed)
            results.append(
                {
                    "fault": kind,
                    "node": node,
                    "found_s": round(found["time"] - onset, 1) if found else None,
                    "cause": found and found["cause"],
                    "measured": found and found.get("measured", "compute"),
                    "ratio": found and found["ratio"],
                    "speed": round(before / during, 2) if during else None,
                    "step_s": [round(before, 3), round(during, 3)],
                }
            )
            time.sleep(args.gap)
    finally:
        subprocess.run(["scancel", job], timeout=30, check=False)
        time.sleep(3)
        cluster.down()
    evs = _events(job_dir)
    named = {(r["node"]) for r in results}
    alarms = [
        {"node": e["node"], "cause": e["cause"], "at_s": round(e["time"] - began, 1)}
        for e in evs
        if e["event"] in ("straggler_detected", "hang_detected")
        and (
            e["event"] == "hang_detected"
            or e["node"] not in named
            or e["time"] < began + args.healthy
        )
    ]
    print(
        json.dumps(
            {
                "faults": results,
                "false_alarms": alarms,
                "healthy_s": args.healthy,
                "restarts": sum(1 for e in evs if e["event"] == "workers_restarted"),
                "job": job,
                "work": str(work),
            }
        )
    )


if __name__ == "__main__":
    main()
