"""dlrover-hpc: fault-tolerant, elastic distributed PyTorch training for Slurm and bare metal."""

from __future__ import annotations

from importlib import metadata

#: The distribution's name on the package index (and in ``pip show``).
DISTRIBUTION = "dlrover-hpc"


def _installed_version(distribution: str, fallback: str) -> str:
    """The installed version of ``distribution`` (its metadata), or ``fallback`` when it is
    not installed (a checkout on ``PYTHONPATH``)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return fallback


__version__ = _installed_version(DISTRIBUTION, "0.1.0+unknown")


def version_line() -> str:
    """What ``--version`` prints: ours, then torch's (read from its metadata: no import)."""
    return f"{DISTRIBUTION} {__version__} (torch {_installed_version('torch', 'not installed')})"
