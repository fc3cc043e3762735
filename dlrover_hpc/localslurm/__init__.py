"""A local multi-node Slurm on this one machine (``dlrover-hpc local-slurm``): slurmctld and
several slurmd, each node in a network namespace of its own."""

from dlrover_hpc.localslurm.local_slurm import LocalSlurm, LocalSlurmConfig
from dlrover_hpc.localslurm.wait import wait_for

__all__ = ["LocalSlurm", "LocalSlurmConfig", "wait_for"]
