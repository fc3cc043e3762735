"""Public contracts of the flash-checkpoint package: enums, protocols and file names.

Nothing here imports torch, so the agent can use the saver without paying for it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

from dlrover_hpc.events import EventName

#: DLRover's tracker file name, kept so tools that read it keep working.  It holds the newest
#: committed step as decimal text and is always replaced atomically.
TRACKER_FILE = "dlrover_latest.txt"
#: Our bookkeeping inside a checkpoint directory (commit records).
META_DIR = ".dlrover-hpc"
#: Suffix of every temporary file we write before the final rename.
TMP_MARK = ".dlrover-tmp-"


class StorageType(enum.Enum):
    """Where `save_checkpoint` puts a step: shared memory only, or memory then storage."""

    MEMORY = "memory"
    DISK = "disk"


class PartKind(enum.Enum):
    """How a step is split into parts and laid out on storage."""

    #: one part (global rank 0's), a single file at `path`, `torch.load(path)` reads it
    DDP = "ddp"
    #: one part per rank, `path/rank_<rank>.pt`, each readable with `torch.load`
    RANK = "rank"
    #: one part per rank in torch.distributed.checkpoint's file layout under `path`
    DCP = "dcp"


class CommitCoordinator(Protocol):
    """Agrees, across nodes, that every rank's part of a step is durable.

    A node's saver calls `part_durable` once its ranks' parts of `step` are durable.  Exactly
    one caller (the one that completed the set of `world_size` parts) gets True; it then writes
    the commit record and the tracker and applies retention.
    """

    def part_durable(
        self, *, step: int, ranks: Sequence[int], world_size: int, path: str
    ) -> bool: ...


class EventSink(Protocol):
    """Receives the job events of docs/design/architecture.md (event log)."""

    def emit(self, event: EventName, **fields: Any) -> None: ...


class FaultHook(Protocol):
    """Test seam: called at named points of a persist and a commit (crash injection)."""

    def __call__(self, point: str) -> None: ...
