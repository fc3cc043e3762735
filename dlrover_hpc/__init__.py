"""dlrover-hpc: fault-tolerant, elastic distributed PyTorch training for Slurm and bare metal."""

__version__ = "0.1.0"
