"""Launchers side by side on the local Slurm, same job, same faults, in one run (issue 26).

Each launcher runs a 3-node job (``--nnodes=2:3``, one gloo worker per node, 0.1 s steps) on
the local Slurm, one after the other, and each meets the same faults at the same times after
its first step: a worker SIGKILLed on the third node, then the second node killed outright
(every process in its namespaces; it stays down).  The first node hosts the rendezvous of
torchrun and ft_launcher and dlrover-hpc's master, so it is spared.

- ``dlrover-run``: ``sbatch/train.sbatch`` with ``examples/train.py`` unchanged (a disk
  checkpoint every 5 steps);
- ``dlrover-run --inprocess``: the same sbatch with ``examples/train_flash_ckpt.py
  --inprocess`` (flash checkpoint every 5 steps, survivors kept in-process);
- ``torchrun``: ``srun torchrun --rdzv-backend=c10d`` with ``examples/train.py``;
- ``ft_launcher``: NVIDIA's nvidia-resiliency-ext launcher, torchrun's flags, same script;
- ``torchft``: not a launcher but a library the script is written against, so it runs
  ``benchmarks/peers/train_torchft.py`` (the same model and steps; a replica group per node
  under a standalone torchrun, a lighthouse on the first node, no checkpoint: a restarted
  replica heals from a live one).

Per fault: the stall (from the fault until rank 0 logs a step past the one it had reached)
and the steps done again; per launcher: whether the job reached its last step, and goodput
(steps x ideal step time / wall from the first step to the last; the ideal step is the median
step interval of the same run).  A launcher that has not gone past a fault 150 s after it
stalled is counted as not recovering.

Needs root (the local Slurm) and ``bash benchmarks/peers_venv.sh`` first.  Prints one JSON
line.

    python benchmarks/side_by_side.py [--launchers dlrover-run,torchrun,...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the tests' harness: chaos, soaks, ports

from harness.soak import job_state  # noqa: E402

from dlrover_hpc.localslurm import LocalSlurm, LocalSlurmConfig  # noqa: E402
from dlrover_hpc.localslurm.slurm_net import netns_pids  # noqa: E402

PEERS = REPO / ".venv-peers" / "bin"
NODES = ("node1", "node2", "node3")
STEP_S = 0.1
STEPS = 900  # ~100 s of training with no fault
FAULTS = (("worker_kill", "node3", 20.0), ("node_crash", "node2", 50.0))
GIVE_UP_S = 150.0
LAUNCHERS = ("dlrover-run", "dlrover-run --inprocess", "torchrun", "ft_launcher", "torchft")
PEER_SBATCH = """#!/bin/bash
#SBATCH --no-kill
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1 \\
    "$LAUNCHER" --nnodes=2:3 --nproc-per-node=1 --rdzv-backend=c10d \\
    --rdzv-endpoint="$head:29400" --rdzv-id="$SLURM_JOB_ID" \\
    --max-restarts=5 "$@"
"""
# torchft: a lighthouse beside the batch script (the first node), a replica group per node,
# each under a standalone torchrun that restarts it; flags as torchft's Slurm example has them.
TORCHFT_SBATCH = """#!/bin/bash
#SBATCH --no-kill
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
torchft_lighthouse --min_replicas 2 --quorum_tick_ms 100 --join_timeout_ms 10000 &
export TORCHFT_LIGHTHOUSE="http://$head:29510"
srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1 bash -c \
    'REPLICA_GROUP_ID=$SLURM_NODEID exec torchrun --standalone --nnodes=1 --nproc-per-node=1 \
     --max-restarts=5 "$@"' torchft "$@"
"""


def _log(timing: Path) -> list[tuple[float, int]]:
    if not timing.exists():
        return []
    rows = []
    for line in timing.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2:
            rows.append((float(parts[0]), int(parts[1])))
    return rows


def _worker_pid(cluster: LocalSlurm, node: str, script: str) -> int | None:
    """A training process of the node: its command line runs the script, and it is no
    launcher, agent or shell."""
    launchers = ("torchrun", "ft_launcher", "dlrover-run", "srun", "bash", "zygote")
    for pid in netns_pids(cluster.config, node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        text = " ".join(argv)
        if script in text and not any(word in text for word in launchers):
            return pid
    return None


def _submit(launcher: str, work: Path, timing: Path) -> tuple[str, str]:
    """Submit the job; (job id, the training script's name)."""
    env = dict(os.environ)
    for k in ("DLROVER_HPC_TOKEN", "DLROVER_HPC_MASTER"):
        env.pop(k, None)
    inprocess = launcher.endswith("--inprocess")
    name = "train_flash_ckpt.py" if inprocess else "train.py"
    script = REPO / "examples" / name
    common = [f"--steps={STEPS}", f"--step-time={STEP_S}", f"--timing-log={timing}"]
    (work / "ckpt").mkdir()
    if inprocess:
        args = [*common, f"--ckpt-dir={work / 'ckpt'}", "--save-every=5", "--persist-every=50"]
        args.append("--inprocess")
    elif launcher == "torchft":
        script = REPO / "benchmarks" / "peers" / "train_torchft.py"
        args = common  # no checkpoint: a restarted replica heals from a live one
    else:
        args = [*common, f"--ckpt-dir={work / 'ckpt'}", "--ckpt-every=5"]
    if launcher.startswith("dlrover-run"):
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        batch = [str(REPO / "sbatch" / "train.sbatch"), "--nnodes=2:3", "--nproc-per-node=1"]
        batch += ["--max-restarts=5", str(script)]
    else:
        env["PATH"] = f"{PEERS}:{env.get('PATH', '')}"
        env["LAUNCHER"] = str(PEERS / launcher)
        job_script = work / "peer.sbatch"
        job_script.write_text(TORCHFT_SBATCH if launcher == "torchft" else PEER_SBATCH)
        batch = [str(job_script), str(script)]
    argv = ["sbatch", "--parsable", f"-N{len(NODES)}", "-o", str(work / "slurm-%j.out")]
    job = subprocess.run(
        [*argv, *batch, *args], cwd=work, env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    return job, script.name


def _one(cluster: LocalSlurm, launcher: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix="side-", dir="/tmp"))
    os.chmod(work, 0o1777)
    timing = work / "timing.log"
    job, script = _submit(launcher, work, timing)
    deadline = time.time() + 180
    while not _log(timing):
        if time.time() > deadline or job_state(job) not in ("PENDING", "RUNNING"):
            subprocess.run(["scancel", job], timeout=10, check=False)
            return {"launcher": launcher, "started": False, "job_state": job_state(job)}
        time.sleep(0.2)
    began = _log(timing)[0][0]
    hits: list[dict] = []
    for kind, node, at in FAULTS:
        while time.time() < began + at:
            time.sleep(0.05)
        if kind == "worker_kill":
            pid = _worker_pid(cluster, node, script)
            if pid is not None:
                os.kill(pid, 9)
            hits.append({"kind": kind, "node": node, "at": time.time(), "pid": pid})
        else:
            cluster.kill_node(node)
            hits.append({"kind": kind, "node": node, "at": time.time()})
    deadline = time.time() + GIVE_UP_S + STEPS * STEP_S
    while job_state(job) in ("PENDING", "RUNNING", "COMPLETING") and time.time() < deadline:
        rows = _log(timing)
        if rows and rows[-1][1] >= STEPS:
            break
        if rows and time.time() - rows[-1][0] > GIVE_UP_S:
            break  # stalled for good
        time.sleep(0.5)
    subprocess.run(["scancel", job], timeout=10, check=False)
    rows = _log(timing)
    return {"launcher": launcher, "job": job, **_analyse(rows, hits), "work": str(work)}


def _stall(rows: list[tuple[float, int]], hit: dict, ideal: float) -> dict:
    """The fault's disruption: the first logged step after it that goes back (a restart from
    a checkpoint) or comes after a gap of over 3 ideal steps (a pause, a change in-process).
    The stall runs from the fault to the first step past the one reached before the
    disruption; steps from the disruption up to that one were done again.  None: it never
    went past; no disruption begun within 30 s: the fault cost nothing visible (0)."""
    after = [i for i, (t, _) in enumerate(rows) if t > hit["at"]]
    out = {"kind": hit["kind"], "node": hit["node"], "pid": hit.get("pid")}
    out["at_s"] = round(hit["at"] - rows[0][0], 2) if rows else None
    for i in after:
        t, step = rows[i]
        prev_t, prev_step = rows[i - 1] if i else (hit["at"], step - 1)
        if prev_t > hit["at"] + 30:
            break
        if step <= prev_step or t - prev_t > 3 * ideal:
            resumed = next((t2 for t2, s2 in rows[i:] if s2 > prev_step), None)
            stall = round(resumed - hit["at"], 2) if resumed is not None else None
            return {**out, "stall_s": stall, "redone_steps": max(0, prev_step - step + 1)}
    if after and rows[-1][0] > hit["at"] + 30:
        return {**out, "stall_s": 0.0, "redone_steps": 0}
    return {**out, "stall_s": None, "redone_steps": None}  # the log ends in the window


def _analyse(rows: list[tuple[float, int]], hits: list[dict]) -> dict:
    intervals = [b[0] - a[0] for a, b in itertools.pairwise(rows) if b[1] == a[1] + 1]
    ideal = statistics.median(intervals) if intervals else STEP_S
    faults = [_stall(rows, hit, ideal) for hit in hits]
    last = max((s for _, s in rows), default=0)
    wall = rows[-1][0] - rows[0][0] if len(rows) > 1 else 0.0
    distinct = len({s for _, s in rows})
    return {
        "completed": last >= STEPS,
        "last_step": last,
        "ideal_step_s": round(ideal, 4),
        "goodput": round(distinct * ideal / wall, 3) if wall and last >= STEPS else None,
        "faults": faults,
    }


def _nearest_rank(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank: a value that was measured (the largest for a few)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per launcher, over the repeats: each fault kind's stall (median, p95 by nearest rank,
    and how many recovered), the steps done again, goodput's median and the jobs completed."""
    out: dict[str, dict] = {}
    for launcher in dict.fromkeys(r["launcher"] for r in runs):
        mine = [r for r in runs if r["launcher"] == launcher]
        entry: dict = {
            "repeats": len(mine),
            "completed": sum(bool(r.get("completed")) for r in mine),
        }
        for kind, _, _ in FAULTS:
            hits = [f for r in mine for f in r.get("faults", []) if f["kind"] == kind]
            stalls = [f["stall_s"] for f in hits if f["stall_s"] is not None]
            entry[kind] = {
                "recovered": f"{len(stalls)}/{len(mine)}",
                "stall_median_s": round(statistics.median(stalls), 2) if stalls else None,
                "stall_p95_s": _nearest_rank(stalls, 0.95) if stalls else None,
                "redone_steps": sum(f["redone_steps"] or 0 for f in hits),
            }
        goodputs = [r["goodput"] for r in mine if r.get("goodput") is not None]
        entry["goodput_median"] = round(statistics.median(goodputs), 3) if goodputs else None
        out[launcher] = entry
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launchers", default=",".join(LAUNCHERS))
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every launcher this many times, interleaved (launcher by launcher in each "
        "repeat), for medians and p95s",
    )
    args = p.parse_args()
    launchers = args.launchers.split(",")
    if any(not launcher.startswith("dlrover-run") for launcher in launchers):
        peers = ("torchrun", "ft_launcher", "torchft_lighthouse")
        missing = [n for n in peers if not (PEERS / n).exists()]
        if missing:
            sys.exit(f"{PEERS}: no {', '.join(missing)}; run: bash benchmarks/peers_venv.sh")
    cluster = LocalSlurm(LocalSlurmConfig(nodes=len(NODES)))
    state = cluster._load_state() or {}
    if cluster.is_up() and state.get("nodes") != cluster.config.node_names():
        LocalSlurm().down()
    runs = []
    for _ in range(args.repeats):
        for launcher in launchers:
            cluster.up()  # each launcher on a whole cluster (the last one lost a node)
            try:
                runs.append(_one(cluster, launcher))
            finally:
                cluster.down()
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # progress, for the patient
    summary = {
        "bench": "side_by_side",
        "faults": [f[0] for f in FAULTS],
        "repeats": args.repeats,
        "summary": summarize(runs),
        "runs": runs,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
