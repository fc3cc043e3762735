"""Errors of the bare-metal launcher (imports nothing else from the package but its errors)."""

from __future__ import annotations

from dlrover_hpc.errors import DlroverHpcError, UsageError


class HostfileError(UsageError):
    """A hostfile or blocklist line is malformed: ``FILE:LINE: what is wrong; how to fix``."""


class LaunchError(DlroverHpcError):
    """The job could not be started on the hosts (unreachable, untrusted, too few left)."""
