"""Flash checkpoint: shared-memory saves, agent-owned asynchronous persistence, fast restore.

DLRover's trainer API (`DdpCheckpointer`, `FsdpShardCheckpointer`, `StorageType`) plus a
generic per-rank checkpointer (`RankCheckpointer`).  The package is laid out by role:

- `trainer/`: what runs inside the training process (imports torch): the checkpointers,
  the engine behind them, restore agreement across ranks, CUDA staging, DCP storage;
- `saver/`: what runs in the agent and never imports torch: shared-memory segments, the
  persist queue, commits (counting, records, tracker), storage, `SaverHost` and the
  worker <-> saver socket protocol;
- `formats/`: the on-disk formats (torch.save archives, their ZIP container, DCP layout);
- at the top, what both sides share: `api` (contracts), `env` (names), `event_sinks`.

Names are imported on first use, so the agent can import the saver without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CommitCoordinator": "api",
    "EventSink": "api",
    "PartKind": "api",
    "StorageType": "api",
    "CommitCounter": "saver.commits",
    "LocalCommitCoordinator": "saver.commits",
    "StoreCommitCoordinator": "saver.commits",
    "DdpCheckpointer": "trainer.torchfile_checkpointer",
    "RankCheckpointer": "trainer.torchfile_checkpointer",
    "JsonlEventSink": "event_sinks",
    "FsdpShardCheckpointer": "trainer.fsdp_checkpointer",
    "SaverHost": "saver.host",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from dlrover_hpc.checkpoint.api import CommitCoordinator as CommitCoordinator
    from dlrover_hpc.checkpoint.api import EventSink as EventSink
    from dlrover_hpc.checkpoint.api import PartKind as PartKind
    from dlrover_hpc.checkpoint.api import StorageType as StorageType
    from dlrover_hpc.checkpoint.event_sinks import JsonlEventSink as JsonlEventSink
    from dlrover_hpc.checkpoint.saver.commits import CommitCounter as CommitCounter
    from dlrover_hpc.checkpoint.saver.commits import (
        LocalCommitCoordinator as LocalCommitCoordinator,
    )
    from dlrover_hpc.checkpoint.saver.commits import (
        StoreCommitCoordinator as StoreCommitCoordinator,
    )
    from dlrover_hpc.checkpoint.saver.host import SaverHost as SaverHost
    from dlrover_hpc.checkpoint.trainer.fsdp_checkpointer import (
        FsdpShardCheckpointer as FsdpShardCheckpointer,
    )
    from dlrover_hpc.checkpoint.trainer.torchfile_checkpointer import (
        DdpCheckpointer as DdpCheckpointer,
    )
    from dlrover_hpc.checkpoint.trainer.torchfile_checkpointer import (
        RankCheckpointer as RankCheckpointer,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dlrover_hpc.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dlrover_hpc.checkpoint.{module}"), name)
    globals()[name] = value
    return value
