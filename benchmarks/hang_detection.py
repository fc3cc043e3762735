"""How long each kind of hang goes unnoticed with the default flags (issue 25, item 2).

A DDP job (0.1 s steps) under ``dlrover-run`` with ``--hang-timeout auto``; at step 60 one
rank hangs, once (a marker file keeps the restarted workers from hanging again):

- ``stopped``: rank 1 SIGSTOPs itself (a GPU or a process that stops);
- ``peer_hang``: rank 1 sleeps forever in Python (a deadlock): rank 0 waits in the all-reduce;
- ``loader``: rank 1's data-loader worker blocks forever mid-epoch;
- ``link_cut``: on the local Slurm (3 nodes, gloo on the data network ``eth1``), node3's data
  link goes down while its control link (the master, Slurm) stays up.

With ``--backend nccl`` (a CUDA GPU) the standalone kinds run with NCCL: the survivor waits in an
NCCL all-reduce (its stack, collected at the detection, is summarised) and NCCL's own timeout
(10 min) never fires first; the job restarts the workers and resumes. Two ranks on one GPU are
two NCCL "hosts" (``NCCL_HOSTID`` per rank, sockets between them), since NCCL refuses two ranks
of one host on one device.

Each must be detected within ``2 x p99 + 10 s`` (at least 30 s) of the job's step time.
Prints one JSON line: per kind the detection latency (``hang_detected`` time minus the fault
time), the bound the master applied and what it came from, and whether the job then finished.

    python benchmarks/hang_detection.py            # all four (link_cut needs root)
    python benchmarks/hang_detection.py --kinds stopped,loader
    python benchmarks/hang_detection.py --kinds stopped,peer_hang,loader --backend nccl
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
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SCRIPT = r"""
import json, os, signal, sys, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

kind, marker, steps, backend = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
HANG_AT = 60
device = torch.device("cpu")
if backend == "nccl":
    if torch.cuda.device_count() < int(os.environ["LOCAL_WORLD_SIZE"]):
        # NCCL refuses two ranks of one host on one GPU: each rank its own "host".
        os.environ["NCCL_HOSTID"] = "hang-bench-rank" + os.environ["RANK"]
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(device)
dist.init_process_group(backend)
rank = dist.get_rank()
torch.manual_seed(0)
torch.set_num_threads(1)
first = not os.path.exists(marker)
resumed = os.path.join(os.path.dirname(marker), "resumed.json")


def write_json(path, record):
    # whole or not at all: the harness reads the file as soon as it appears
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def hang_now():
    write_json(marker, {"time": time.time(), "kind": kind})


class Samples(Dataset):
    def __len__(self):
        return 10**6

    def __getitem__(self, i):
        if kind == "loader" and rank == 1 and first and i == HANG_AT:
            hang_now()
            while True:
                time.sleep(3600)  # blocked forever in the data loader's worker
        return torch.randn(16)


net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1)).to(device)
model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
step = 0
for x in DataLoader(Samples(), batch_size=1, num_workers=1):
    x = x.to(device)
    step += 1
    if step > steps:
        break
    if step == HANG_AT and rank == 1 and first:
        if kind == "stopped":
            hang_now()
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "peer_hang":
            hang_now()
            while True:
                time.sleep(3600)
        elif kind == "link_cut":
            hang_now()  # the harness cuts the link when it sees the marker
    time.sleep(0.1)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    loss.item()  # the loss logged each step: the host waits for the step's collectives
    if not first and rank == 0 and not os.path.exists(resumed):
        write_json(resumed, {"time": time.time(), "step": step})
"""


def _events(job_dir: Path) -> list[dict]:
    path = job_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _summary(kind: str, work: Path, job_dir: Path, rc: int | None) -> dict:
    marker = json.loads((work / "marker.json").read_text())
    hangs = [e for e in _events(job_dir) if e["event"] == "hang_detected"]
    out: dict = {"finished": rc == 0}
    if hangs:
        h = hangs[0]
        out.update(
            latency_s=round(h["time"] - marker["time"], 1),
            bound_s=h["bound_s"],
            bound_from=h["bound_from"],
            step_p99_s=h["step_p99_s"],
            suspected_rank=h["suspected_rank"],
            why=h["why"],
        )
        out["within_bound"] = out["latency_s"] <= h["bound_s"] + 10.0
        out["survivor_stack"] = _survivor_frames(Path(h["directory"]), h["suspected_rank"])
    else:
        out["latency_s"] = None
    resumed = work / "resumed.json"
    if resumed.exists():  # the restarted workers' first whole step after the fault
        out["recovered_s"] = round(json.loads(resumed.read_text())["time"] - marker["time"], 1)
    return out


def _survivor_frames(directory: Path, suspect: int) -> list[str]:
    """The innermost frames of a survivor's main thread: where the survivors waited."""
    for path in sorted(directory.glob("rank-*.txt")):
        if path.stem != f"rank-{suspect}":
            lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
            main = [i for i, ln in enumerate(lines) if ln.startswith("Thread") and "(main)" in ln]
            return lines[main[0] : main[0] + 4] if main else lines[:4]
    return []


def _dlrover_run() -> list[str]:
    script = Path(sys.executable).parent / "dlrover-run"
    return [str(script)] if script.exists() else [sys.executable, "-m", "dlrover_hpc.cli.run"]


def standalone(kind: str, work: Path, steps: int, backend: str) -> dict:
    script = work / "job.py"
    script.write_text(SCRIPT)
    job_dir = work / "job"
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [
            *_dlrover_run(),
            "--standalone",
            "--nproc-per-node=2",
            f"--job-dir={job_dir}",
            f"--rdzv-id=hang-{kind}",
            str(script),
            kind,
            str(work / "marker.json"),
            str(steps),
            backend,
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath},
    )
    out = _summary(kind, work, job_dir, proc.returncode)
    if proc.returncode != 0:
        out["log_tail"] = proc.stderr[-1500:]
    return out


def link_cut(work: Path, steps: int) -> dict:
    from dlrover_hpc.localslurm import LocalSlurm, LocalSlurmConfig

    cluster = LocalSlurm(LocalSlurmConfig())
    was_up = cluster.is_up()
    cluster.up()
    try:
        return _link_cut(cluster, work, steps)
    finally:
        if not was_up:  # one it brought up goes down again (daemons, namespaces)
            cluster.down()


def _link_cut(cluster: Any, work: Path, steps: int) -> dict:
    os.chmod(work, 0o1777)
    script = work / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env["GLOO_SOCKET_IFNAME"] = "eth1"  # training on the data network, control on eth0
    for k in ("DLROVER_HPC_TOKEN", "DLROVER_HPC_MASTER"):
        env.pop(k, None)
    job = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-N3",
            "-w",
            "node[1-3]",
            "-o",
            str(work / "slurm-%j.out"),
            str(REPO / "sbatch" / "train.sbatch"),
            "--nnodes=3",
            "--nproc-per-node=1",
            str(script),
            "link_cut",
            str(work / "marker.json"),
            str(steps),
            "gloo",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    job_dir = work / ".dlrover-hpc" / job
    deadline = time.time() + 300
    while not (work / "marker.json").exists() and time.time() < deadline:
        time.sleep(0.2)
    rounds = [e for e in _events(job_dir) if e["event"] == "rendezvous_complete"]
    victim = rounds[-1]["nodes"][1]  # rank 1's node
    cluster.cut_link(victim, net="data")
    try:
        while time.time() < deadline and not [
            e for e in _events(job_dir) if e["event"] == "hang_detected"
        ]:
            time.sleep(0.5)
    finally:
        cluster.heal_link(victim, net="data")
    while (
        time.time() < deadline + 300
        and subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True
        ).stdout.strip()
    ):
        time.sleep(1)
    finished = [e for e in _events(job_dir) if e["event"] == "job_finished"]
    out = _summary("link_cut", work, job_dir, finished[-1]["exit_code"] if finished else None)
    out["cut"] = victim
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="stopped,peer_hang,loader,link_cut")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = p.parse_args()
    results: dict = {}
    meta: dict = {"backend": args.backend}
    if args.backend == "nccl":
        import torch
        import torch.distributed as dist

        if not torch.cuda.is_available():
            sys.exit("--backend nccl needs a CUDA GPU")
        meta["nccl"] = {
            "version": ".".join(map(str, torch.cuda.nccl.version())),
            "device": torch.cuda.get_device_name(0),
            "timeout_s": dist.constants.default_pg_nccl_timeout.total_seconds(),
            "torch": torch.__version__,
        }
    for kind in args.kinds.split(","):
        with tempfile.TemporaryDirectory(prefix=f"hang-{kind}-", dir="/tmp") as tmp:
            work = Path(tmp)
            results[kind] = (
                link_cut(work, args.steps)
                if kind == "link_cut"
                else standalone(kind, work, args.steps, args.backend)
            )
    print(json.dumps({"kinds": results, **meta, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ")}))


if __name__ == "__main__":
    main()
