"""DLRover's ``dlrover.python.common.storage`` under our module path: storages and strategies.

A DLRover script that imports from ``dlrover.python.common.storage`` imports the same names
from ``dlrover_hpc.trainer.storage``.  The deletion strategies behave as DLRover's when called
(`clean_up(step, delete_func)`), and the flash checkpointers of
`dlrover_hpc.trainer.flash_checkpoint` read their settings and map them to our retention:
the agent's saver applies it when it commits a step, so it also holds for steps persisted
after a worker died.  `PosixDiskStorage` is accepted wherever DLRover takes a `storage`; our
saver writes through fsspec, so any fsspec URL works as a checkpoint directory.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: DLRover's `CheckpointConstant.TRACER_FILE_NAME`: the newest committed step, as text
TRACKER_FILE_NAME = "dlrover_latest.txt"


@dataclasses.dataclass
class ClassMeta:
    """How to build a storage again (DLRover sends it to its saver process)."""

    module_path: str = ""
    class_name: str = ""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


class CheckpointStorage(abc.ABC):
    """DLRover's storage interface; ours is fsspec, so only `PosixDiskStorage` is accepted."""

    @abc.abstractmethod
    def write(self, content: str | bytes | memoryview, path: str) -> None: ...

    @abc.abstractmethod
    def read(self, path: str) -> Any: ...

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    def get_class_meta(self) -> ClassMeta:
        return ClassMeta(module_path=type(self).__module__, class_name=type(self).__name__)


class PosixDiskStorage(CheckpointStorage):
    """A local file system, as DLRover's `PosixDiskStorage`."""

    def write(self, content: str | bytes | memoryview, path: str) -> None:
        data = content.encode() if isinstance(content, str) else bytes(content)
        with open(path, "wb") as stream:
            stream.write(data)
            os.fsync(stream.fileno())

    def write_state_dict(
        self, state_dict: Any, path: str, write_func: Callable[[Any, str], None] | None = None
    ) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if write_func:
            write_func(state_dict, path)

    def read(self, path: str, mode: str = "r") -> Any:
        if not os.path.exists(path):
            return ""
        with open(path, mode) as stream:
            return stream.read()

    def read_state_dict(self, path: str, read_func: Callable[[str], Any] | None) -> Any:
        if not os.path.exists(path) or not read_func:
            return {}
        return read_func(path)

    def safe_rmtree(self, dir: str) -> None:
        if os.path.exists(dir):
            shutil.rmtree(dir, ignore_errors=True)

    def safe_remove(self, path: str) -> None:
        if os.path.exists(path):
            os.remove(path)

    def safe_makedirs(self, dir: str) -> None:
        os.makedirs(dir, exist_ok=True)

    def safe_move(self, src_path: str, dst_path: str) -> None:
        if os.path.exists(src_path) and not os.path.exists(dst_path):
            shutil.move(src_path, dst_path)

    def commit(self, step: int, success: bool) -> None:
        """Called when a step's checkpoint is persisted (DLRover's hook)."""
        logger.info("checkpoint commit step=%d success=%s", step, success)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)


class CheckpointDeletionStrategy(abc.ABC):
    """Which step directories to delete once a newer step is committed."""

    @abc.abstractmethod
    def clean_up(self, step: int, delete_func: Callable[[str], Any]) -> None:
        """Cleans up the checkpoint of `step` (the step committed before the newest one);
        `delete_func` removes a directory."""


def _delete(directory: str, delete_func: Callable[[str], Any]) -> None:
    try:
        logger.info("checkpoint clean path=%s", directory)
        delete_func(directory)
    except Exception:  # DLRover's behaviour: a failed clean-up is only a warning
        logger.warning("checkpoint clean_failed path=%s", directory)


class KeepStepIntervalStrategy(CheckpointDeletionStrategy):
    """Keeps the steps that are multiples of `keep_interval` (and the newest step); deletes
    `checkpoint_dir/<step>` of the others once a newer step is committed."""

    def __init__(self, keep_interval: int, checkpoint_dir: str) -> None:
        if int(keep_interval) < 1:
            raise ValueError(f"keep_interval={keep_interval} must be at least 1")
        self._keep_interval = int(keep_interval)
        self._checkpoint_dir = checkpoint_dir

    @property
    def keep_interval(self) -> int:
        return self._keep_interval

    @property
    def checkpoint_dir(self) -> str:
        return self._checkpoint_dir

    def clean_up(self, step: int, delete_func: Callable[[str], Any]) -> None:
        if step % self._keep_interval != 0:
            _delete(os.path.join(self._checkpoint_dir, str(step)), delete_func)


class KeepLatestStepStrategy(CheckpointDeletionStrategy):
    """Keeps the newest `max_to_keep` steps (at least 1); deletes `checkpoint_dir/<step>` of
    older ones."""

    def __init__(self, max_to_keep: int, checkpoint_dir: str) -> None:
        self._max_to_keep = max(int(max_to_keep), 1)
        self._checkpoint_dir = checkpoint_dir
        self._steps: list[int] = []

    @property
    def max_to_keep(self) -> int:
        return self._max_to_keep

    @property
    def checkpoint_dir(self) -> str:
        return self._checkpoint_dir

    def clean_up(self, step: int, delete_func: Callable[[str], Any]) -> None:
        self._steps.append(step)
        if len(self._steps) == self._max_to_keep:
            old = self._steps.pop(0)
            _delete(os.path.join(self._checkpoint_dir, str(old)), delete_func)


class PosixStorageWithDeletion(PosixDiskStorage):
    """A local file system whose old steps a deletion strategy cleans up (DLRover's)."""

    def __init__(self, tracker_file: str, deletion_strategy: CheckpointDeletionStrategy) -> None:
        super().__init__()
        self._deletion_strategy = deletion_strategy
        self._tracker_file = tracker_file
        self._pre_step = 0

    @property
    def deletion_strategy(self) -> CheckpointDeletionStrategy:
        return self._deletion_strategy

    def write(self, content: str | bytes | memoryview, path: str) -> None:
        path = str(path)
        if path.endswith(self._tracker_file):
            previous = self.read(path)
            if previous:
                self._pre_step = int(previous)
        super().write(content, path)

    def commit(self, step: int, success: bool) -> None:
        super().commit(step, success)
        if not success or self._pre_step in (0, step):
            return
        self._deletion_strategy.clean_up(self._pre_step, shutil.rmtree)

    def get_class_meta(self) -> ClassMeta:
        kwargs = {"tracker_file": self._tracker_file, "deletion_strategy": self._deletion_strategy}
        return ClassMeta(
            module_path=type(self).__module__, class_name=type(self).__name__, kwargs=kwargs
        )


def get_checkpoint_storage(
    deletion_strategy: CheckpointDeletionStrategy | None = None,
) -> PosixDiskStorage:
    """DLRover's factory: a `PosixStorageWithDeletion` with a strategy, else a plain one."""
    if deletion_strategy:
        return PosixStorageWithDeletion(TRACKER_FILE_NAME, deletion_strategy)
    return PosixDiskStorage()
