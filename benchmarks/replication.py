"""What cross-node memory replicas (``replica_count=1``) cost a training step (issue 17).

Two "nodes" on this machine: node A's agent side (a real ``SaverHost`` with a
``ReplicaSender``, as ``dlrover-run`` builds it) in this process, node B's ``ReplicaServer``
in a child process, each with its own shared-memory directory, talking TCP on loopback.  A
training process (a child, like a worker) runs a step of real work (an MLP's forward,
backward and Adam on one thread) and, every ``--save-every`` steps, a MEMORY save of
``--state-mib`` of per-rank state through ``RankCheckpointer`` and the agent's socket.  Runs
alternate between ``replica_count=0`` and ``=1`` so both see the same machine.

Prints one JSON line: the median step time of each mode, their ratio, the extra seconds per
step, and what the copies cost: bytes sent per step, the seconds a copy took, copies torn
by the next save into the same buffer (two saves later: then the copy is skipped, and the
peer keeps an older step).  On this 2-core machine the sender, the receiver and the training share
two cores; on a cluster the receiver is another node.

    python benchmarks/replication.py --state-mib 64 --steps 60 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dlrover_hpc.checkpoint import LocalCommitCoordinator, SaverHost  # noqa: E402
from dlrover_hpc.checkpoint.env import current_user, segment_prefix  # noqa: E402
from dlrover_hpc.checkpoint.event_sinks import ListEventSink  # noqa: E402
from dlrover_hpc.checkpoint.saver.replica_sender import ReplicaSender  # noqa: E402

TOKEN = "bench-" + os.urandom(8).hex()

RECEIVER = r"""
import sys, time
from dlrover_hpc.checkpoint.saver.replicas import ReplicaServer
shm, prefix, token = sys.argv[1:4]
server = ReplicaServer(shm_dir=shm, prefix=prefix, token=token, host="127.0.0.1", node_name="B")
server.start()
print(server.address[1], flush=True)
sys.stdin.read()  # until the parent closes it
server.close()
"""

WORKER = r"""
import json, os, sys, time
import torch
from dlrover_hpc.checkpoint import RankCheckpointer, StorageType
steps, replicas, every = (int(a) for a in sys.argv[1:4])
mib, out, ckpt_dir = float(sys.argv[4]), sys.argv[5], sys.argv[6]
torch.manual_seed(0)
torch.set_num_threads(1)
layers = []
for _ in range(8):
    layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(128, 512)
extra = torch.zeros(int(mib * 2**20) // 4)  # per-rank state beyond the model (a shard)
ckpt = RankCheckpointer(ckpt_dir, replica_count=replicas)
times, blocking = [], []
for step in range(1, steps + 1):
    t0 = time.perf_counter()
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    extra.fill_(float(step))
    t1 = time.perf_counter()
    if step % every == 0:
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra}
        ckpt.save_checkpoint(step, state, storage_type=StorageType.MEMORY)
        blocking.append(time.perf_counter() - t1)
    times.append(time.perf_counter() - t0)
ckpt.close(remove_segments=False)
json.dump({"times": times[steps // 5:], "blocking": blocking[steps // 5:]}, open(out, "w"))
"""


def run(replicas: int, args: argparse.Namespace, host: SaverHost, tmp: str) -> dict:
    out = os.path.join(tmp, f"r{replicas}.json")
    env = {
        **os.environ,
        "DLROVER_HPC_SAVER_SOCKET": host.socket_path,
        "DLROVER_HPC_JOB_ID": host.job_id,
        "DLROVER_HPC_NODE_NAME": host.node_name,
        "DLROVER_HPC_SHM_DIR": host.shm_dir,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    cmd = [
        sys.executable,
        "-c",
        WORKER,
        str(args.steps),
        str(replicas),
        str(args.save_every),
        str(args.state_mib),
        out,
        os.path.join(tmp, "ckpt"),
    ]
    subprocess.run(cmd, env=env, check=True)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-mib", type=float, default=64.0, help="per-rank state beyond the model")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=1, help="a MEMORY save every N steps")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    tmp = tempfile.mkdtemp(prefix="dlrover-hpc-bench-repl-")
    shm_a = tempfile.mkdtemp(prefix="dlrover-hpc-bench-a-", dir="/dev/shm")
    shm_b = tempfile.mkdtemp(prefix="dlrover-hpc-bench-b-", dir="/dev/shm")
    job = f"bench{os.getpid()}"
    prefix_b = segment_prefix(user=current_user(), job_id=job, node_name="nodeB")
    receiver = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, shm_b, prefix_b, TOKEN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    events = ListEventSink()
    host = None
    try:
        assert receiver.stdout is not None
        port = int(receiver.stdout.readline())
        prefix_a = segment_prefix(user=current_user(), job_id=job, node_name="nodeA")
        sender = ReplicaSender(
            shm_dir=shm_a, prefix=prefix_a, token=TOKEN, node_name="nodeA", events=events
        )
        host = SaverHost(
            job_id=job,
            node_name="nodeA",
            socket_path=os.path.join(tmp, "saver.sock"),
            commit=LocalCommitCoordinator(),
            events=events,
            shm_dir=shm_a,
            replicas=sender,
        )
        host.start()
        host.set_replica_peers(0, ["", f"127.0.0.1:{port}"])
        modes: dict[int, list[dict]] = {0: [], 1: []}
        for _ in range(args.repeats):
            for replicas in (0, 1):
                before = sender.stats()
                result = run(replicas, args, host, tmp)
                sender.wait_idle(60)
                after = sender.stats()
                result["sent"] = {k: after[k] - before[k] for k in after}
                modes[replicas].append(result)
        base = statistics.median(t for r in modes[0] for t in r["times"])
        repl = statistics.median(t for r in modes[1] for t in r["times"])
        copies = events.named("checkpoint_replicated")
        sent = [r["sent"] for r in modes[1]]
        steps = args.steps * args.repeats
        print(
            json.dumps(
                {
                    "state_mib": args.state_mib,
                    "steps_per_run": args.steps,
                    "save_every": args.save_every,
                    "repeats": args.repeats,
                    "step_s": {"replicas_0": round(base, 5), "replicas_1": round(repl, 5)},
                    "step_ratio": round(repl / base, 3),
                    "extra_s_per_step": round(repl - base, 5),
                    "save_blocking_s": {
                        f"replicas_{k}": round(
                            statistics.median(b for r in v for b in r["blocking"]), 5
                        )
                        for k, v in modes.items()
                    },
                    "bytes_per_copy": copies[-1]["bytes"] if copies else 0,
                    "copies": sum(s["copies"] for s in sent),
                    "saves": steps // args.save_every,
                    "bytes_sent_per_step": round(sum(s["bytes"] for s in sent) / steps),
                    "copy_s_median": round(statistics.median(e["seconds"] for e in copies), 4)
                    if copies
                    else None,
                    "torn": sum(s["torn"] for s in sent),
                    "failures": sum(s["failures"] for s in sent),
                    "loadavg_1m": os.getloadavg()[0],
                }
            )
        )
    finally:
        if host is not None:
            host.close(remove_segments=True)
        if receiver.stdin is not None:
            receiver.stdin.close()
        receiver.wait(30)
        for d in (tmp, shm_a, shm_b):
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
