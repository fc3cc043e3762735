"""Slurm host lists (``node[01-04,07],gpu-b7``) through python-hostlist, never by hand."""

from __future__ import annotations

import hostlist

from dlrover_hpc.errors import UsageError


def expand(text: str, *, source: str = "host list") -> list[str]:
    """``node[1-3],gpu7`` -> ``["node1", "node2", "node3", "gpu7"]`` (order kept)."""
    text = text.strip()
    if not text:
        return []
    try:
        return list(hostlist.expand_hostlist(text, allow_duplicates=True, sort=False))
    except hostlist.BadHostlist as exc:
        raise UsageError(
            f"{source}: {text!r} is not a valid Slurm host list ({exc}); "
            "expected e.g. node[01-04,07],gpu-b7"
        ) from None


def collect(hosts: list[str]) -> str:
    """The compact Slurm form of ``hosts``."""
    return str(hostlist.collect_hostlist(hosts))
