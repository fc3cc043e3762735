"""DLRover's ``flash_checkpoint.checkpointer``: `StorageType` and the `Checkpointer` base.

`StorageType` is `dlrover_hpc.checkpoint.StorageType` itself (MEMORY: shared memory only;
DISK: shared memory, then the agent's saver persists it), so values pass unchanged to our
checkpointers.
"""

from __future__ import annotations

import abc
from typing import Any

from dlrover_hpc.checkpoint.api import StorageType

__all__ = ["SAVE_TIMEOUT", "Checkpointer", "StorageType"]

#: DLRover's `CheckpointConstant.SAVE_TIMEOUT` (seconds), the default of `save_timeout`
SAVE_TIMEOUT = 600


class Checkpointer(abc.ABC):
    """Saves state dicts to shared memory at once and to storage asynchronously; loads the
    newest checkpoint from memory when a node still holds it, else from storage."""

    @abc.abstractmethod
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Saves a step (DLRover: `step, state_dict, path, storage_type=StorageType.DISK`)."""

    @abc.abstractmethod
    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Loads the newest step, or the one at the resume path when memory holds none."""
