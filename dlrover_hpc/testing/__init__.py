"""Public test helpers: a local multi-node Slurm, polling with a deadline, leak snapshots."""

from dlrover_hpc.testing.leaks import LeakSnapshot, take_snapshot
from dlrover_hpc.testing.local_slurm import LocalSlurm, LocalSlurmConfig
from dlrover_hpc.testing.sshd import SshdCluster
from dlrover_hpc.testing.wait import wait_for

__all__ = [
    "LeakSnapshot",
    "LocalSlurm",
    "LocalSlurmConfig",
    "SshdCluster",
    "take_snapshot",
    "wait_for",
]
