"""The tests' own harness (not shipped): chaos and soaks, a real sshd, a real Prometheus, leak
snapshots, each test worker's private mounts.  The local Slurm is a product command
(:mod:`dlrover_hpc.localslurm`)."""

from harness.leaks import LeakSnapshot, take_snapshot
from harness.sshd import SshdCluster

__all__ = ["LeakSnapshot", "SshdCluster", "take_snapshot"]
