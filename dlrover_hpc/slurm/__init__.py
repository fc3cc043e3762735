"""Slurm's commands (scontrol, sbatch, squeue), their output parsed, its task variables."""
