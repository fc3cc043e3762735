"""Error types of dlrover-hpc. This module imports nothing from the package."""


class DlroverHpcError(Exception):
    """Base of every error this package raises on purpose."""


class UsageError(DlroverHpcError):
    """Bad flags or bad input; the CLI exits 2 and prints the message."""


class ConfigError(UsageError):
    """A configuration value is invalid; the message says which and how to fix it."""


class TopologyError(UsageError):
    """A topology file is malformed; the message has FILE:LINE: what is wrong."""


class SlurmError(DlroverHpcError):
    """A Slurm command failed or printed something we could not parse."""


class LocalSlurmError(DlroverHpcError):
    """The local multi-node Slurm could not be brought up or down."""


class ProtocolError(DlroverHpcError):
    """A malformed, unauthenticated or unexpected frame on the wire."""


class AuthError(ProtocolError):
    """A peer failed the job-token challenge."""


class CheckpointError(DlroverHpcError):
    """A checkpoint could not be saved, persisted or loaded."""


class SegmentSpaceError(CheckpointError):
    """A segment's file system (/dev/shm) has no room for a save of this size."""


class RestoreRejectedError(CheckpointError):
    """Every step a restore could load failed its check (a NaN, the user's `validate`), so
    no state was restored; the message lists each step and why."""


class ReportError(UsageError):
    """``dlrover-hpc report`` could not read a job's events or write its plot (exit 2)."""
