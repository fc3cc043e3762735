"""Flash checkpoint: shared-memory saves, agent-owned asynchronous persistence, fast restore.

DLRover's trainer API (`DdpCheckpointer`, `FsdpShardCheckpointer`, `StorageType`) plus a
generic per-rank checkpointer (`RankCheckpointer`); the agent side is `saver.SaverHost`.

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
    "LocalCommitCoordinator": "commit",
    "StoreCommitCoordinator": "commit",
    "DdpCheckpointer": "ddp",
    "RankCheckpointer": "ddp",
    "JsonlEventSink": "events",
    "FsdpShardCheckpointer": "fsdp",
    "SaverHost": "saver",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from dlrover_hpc.checkpoint.api import CommitCoordinator as CommitCoordinator
    from dlrover_hpc.checkpoint.api import EventSink as EventSink
    from dlrover_hpc.checkpoint.api import PartKind as PartKind
    from dlrover_hpc.checkpoint.api import StorageType as StorageType
    from dlrover_hpc.checkpoint.commit import LocalCommitCoordinator as LocalCommitCoordinator
    from dlrover_hpc.checkpoint.commit import StoreCommitCoordinator as StoreCommitCoordinator
    from dlrover_hpc.checkpoint.ddp import DdpCheckpointer as DdpCheckpointer
    from dlrover_hpc.checkpoint.ddp import RankCheckpointer as RankCheckpointer
    from dlrover_hpc.checkpoint.events import JsonlEventSink as JsonlEventSink
    from dlrover_hpc.checkpoint.fsdp import FsdpShardCheckpointer as FsdpShardCheckpointer
    from dlrover_hpc.checkpoint.saver import SaverHost as SaverHost


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dlrover_hpc.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dlrover_hpc.checkpoint.{module}"), name)
    globals()[name] = value
    return value
