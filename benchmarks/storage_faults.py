"""The storage fault matrix (root): a job checkpointing to a real network file system whose
server stalls, fills, goes read-only, restarts and loses its link.

A 2-node job on the local Slurm (one gloo rank per node, 0.1 s steps, a 16 MiB state saved
to memory every 2 steps and to DISK every 4) checkpoints into a directory every node mounts
with sshfs from a file server in a network namespace of its own (``tests/harness/
fileserver.py``; ``--nfs``: nfs-ganesha and the kernel's client, where it has one).  The
faults come one after the other in the same job: the server SIGSTOPped (``stall``, 40 s by
default), its file system full, read-only, the server killed and started again
(``restart``), its link down (``link_cut``; each 6 s by default).  Prints one JSON line: per
fault kind the steps lost (trained twice), the longest gap between two steps, the step rate
during it against as long before it, and the seconds from the fault's end until the step
trained then is committed on the export; and the job's verdict (its last step, the newest
durable one, exit code).

    python benchmarks/storage_faults.py
    python benchmarks/storage_faults.py --kinds stall --stall-s 30

The suite runs the same matrix (tests/runtime/test_storage_faults.py).  Brings a 4-node
local Slurm up (cluster ``--cluster-index``; a different one that is up is taken down first)
and down again at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the tests' harness: the file server, the matrix

from harness.fileserver import FileServerConfig, NfsServer, SshfsServer  # noqa: E402
from harness.isolation import private_mounts  # noqa: E402
from harness.storage_faults import StorageFault, run_matrix  # noqa: E402

from dlrover_hpc.localslurm import LocalSlurm, LocalSlurmConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(StorageFault), help="comma-separated, in order")
    p.add_argument("--stall-s", type=float, default=40.0, help="how long the server is stopped")
    p.add_argument("--hold-s", type=float, default=6.0, help="how long each other fault lasts")
    p.add_argument("--nfs", action="store_true", help="NFS (nfs-ganesha) instead of sshfs")
    p.add_argument(
        "--cluster-index",
        type=int,
        default=0,
        help="the local Slurm's index (N>0: private /dev/shm and /run/netns, as a test worker)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args()
    kinds = [StorageFault(k) for k in args.kinds.split(",")]
    if args.cluster_index:
        private_mounts()
    cluster = LocalSlurm(LocalSlurmConfig(nodes=4, index=args.cluster_index))
    os.environ["SLURM_CONF"] = str(cluster.config.slurm_conf)
    state = cluster._load_state() or {}
    if cluster.is_up() and state.get("nodes") != cluster.config.node_names():
        cluster.down()
    cluster.up()
    work = Path(tempfile.mkdtemp(prefix="storage-faults-", dir="/tmp"))
    kind = NfsServer if args.nfs else SshfsServer
    server = kind(cluster, FileServerConfig(state_dir=work / "server", mount_point=work / "mnt"))
    try:
        server.up()
        try:
            run = run_matrix(
                server,
                work,
                kinds,
                hold_s=lambda k: args.stall_s if k is StorageFault.STALL else args.hold_s,
            )
        finally:
            server.down()
    finally:
        cluster.down()
    finished = run.finished
    report = {
        "file_system": server.kind,
        "faults": {str(o.kind): o.as_dict() for o in run.outcomes},
        "steps_lost": sum(o.steps_lost for o in run.outcomes),
        "longest_gap_s": round(max((o.longest_gap_s for o in run.outcomes), default=0.0), 2),
        "last_step": run.last_step,
        "export_step": run.export_step,
        "durable_step": finished.get("durable_step"),
        "exit_code": finished.get("exit_code"),
        "job_state": run.state,
        "persist_stalled_events": sum(1 for e in run.events if e["event"] == "persist_stalled"),
        "checkpoint_persist_failed": sum(
            1 for e in run.events if e["event"] == "checkpoint_persist_failed"
        ),
        "work": str(work) if args.keep else None,
    }
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
