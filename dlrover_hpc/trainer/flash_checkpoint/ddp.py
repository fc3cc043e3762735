"""DLRover's ``flash_checkpoint.ddp``: `DdpCheckpointer` for replicated (or per-rank) state.

Backed by `dlrover_hpc.checkpoint.DdpCheckpointer` (replicated state: local rank 0 of each
node keeps it in shared memory, global rank 0's copy is persisted) or, when every rank holds
a shard (`local_shard_num` = ranks per node), by `RankCheckpointer`.  Files are laid out as
DLRover lays them out: `<checkpoint_dir>/<step>/rank_<rank>.pt`, readable with `torch.load`,
and `dlrover_latest.txt` names the newest committed step.
"""

from __future__ import annotations

import posixpath
from typing import Any

from dlrover_hpc.checkpoint.trainer.torchfile_checkpointer import (
    DdpCheckpointer as _ReplicatedCheckpointer,
)
from dlrover_hpc.checkpoint.trainer.torchfile_checkpointer import RankCheckpointer
from dlrover_hpc.trainer.flash_checkpoint import _compat
from dlrover_hpc.trainer.flash_checkpoint.checkpointer import (
    SAVE_TIMEOUT,
    Checkpointer,
    StorageType,
)
from dlrover_hpc.trainer.storage import get_checkpoint_storage

__all__ = ["DdpCheckpointer", "StorageType"]


class _RankFiles(RankCheckpointer):
    """Per-rank files named as DLRover names them: `<step dir>/rank_<rank>.pt`."""

    def _file_name(self) -> str:
        return f"rank_{self.engine.env.rank}.pt"


class DdpCheckpointer(Checkpointer):
    """Flash checkpoints of a DDP model's state dict (DLRover's arguments and calls).

    DLRover's arguments: `checkpoint_dir`; `local_shard_num` / `global_shard_num` (1 and 1,
    or every rank a shard); `comm_backend` (checked; our restore agreement uses the default
    process group); `deletion_strategy` (`KeepLatestStepStrategy` -> keep_last,
    `KeepStepIntervalStrategy` -> keep_interval); `save_timeout` (checked); `replica_count`
    (sharded: copies on that many peer nodes; replicated: every node has a full copy).  Keyword
    `storage` (older DLRover): `PosixDiskStorage` or `PosixStorageWithDeletion`.  Further
    keywords go to our checkpointer (`env`, `events`, `tag`, `keep_last`, `device_snapshot`...).
    """

    def __init__(
        self,
        checkpoint_dir: str,
        local_shard_num: int = 1,
        global_shard_num: int = 1,
        comm_backend: str = "",
        deletion_strategy: Any = None,
        save_timeout: float = SAVE_TIMEOUT,
        replica_count: int = 0,
        *,
        storage: Any = None,
        **options: Any,
    ) -> None:
        env = _compat.worker_env(options)
        self._sharded = _compat.shard_layout(local_shard_num, global_shard_num, env)
        if self._sharded:  # replicated state: every node holds a full copy already
            options["replica_count"] = _compat.check_replica_count(replica_count)
        else:
            _compat.check_replica_count(replica_count)
        _compat.check_comm_backend(comm_backend)
        _compat.check_save_timeout(save_timeout)
        options.update(_compat.retention(checkpoint_dir, deletion_strategy, storage, options))
        self.checkpoint_dir = checkpoint_dir
        self.storage = storage or get_checkpoint_storage(deletion_strategy)
        self._rank = env.rank
        core = _RankFiles if self._sharded else _ReplicatedCheckpointer
        self._ckpt: RankCheckpointer | _ReplicatedCheckpointer = core(checkpoint_dir, **options)

    @property
    def core(self) -> RankCheckpointer | _ReplicatedCheckpointer:
        """Our checkpointer behind this one (`dlrover_hpc.checkpoint`)."""
        return self._ckpt

    @property
    def last_restored(self) -> tuple[int, str] | None:
        """(step, "memory" | "peer" | "storage") of the last load from the agreed step."""
        return self._ckpt.last_restored

    def save_checkpoint(
        self,
        step: int,
        state_dict: Any,
        path: str = "",
        storage_type: StorageType = StorageType.DISK,
    ) -> bool:
        """Copies `state_dict` into shared memory; with DISK the agent's saver then persists
        it to `path` (default `<checkpoint_dir>/<step>/rank_<rank>.pt`).  A MEMORY save's
        `path` is where it goes if the process fails before a DISK save.  False (with a
        warning) when the step could not be kept; the previous checkpoint is then intact."""
        storage_type = _compat.storage_type(storage_type)
        if not path:
            path = posixpath.join(self.checkpoint_dir, str(step), f"rank_{self._rank}.pt")
        return self._ckpt.save_checkpoint(step, state_dict, self._step_path(path), storage_type)

    def _step_path(self, path: str) -> str:
        """Our path of the step: the file itself, or (per-rank files) their directory."""
        if not self._sharded:
            return path
        name = f"rank_{self._rank}.pt"
        if posixpath.basename(path) != name:
            raise _compat.UnsupportedArgument(
                f"path={path!r}: with a shard on every rank, each rank's file is "
                f"<step directory>/rank_<rank>.pt; pass <step directory>/{name} or no path"
            )
        return posixpath.dirname(path)

    def load_checkpoint(self, resume_path: str = "", *, validate: Any = None) -> dict[str, Any]:
        """The newest step held in memory on any node (every rank agrees on it; a rank whose
        node lacks it receives it from a peer); without one, `resume_path` when given (a
        torch.save file; {} when it does not exist), else the newest committed step on
        storage ({} when there is none).  Every rank must call it.

        A step whose state holds a NaN or an infinity (unless made with check_finite=False),
        or for which `validate(state)` (this call's, else the constructor's `validate=`)
        returns False, is rejected and the next older one loaded (`restore_rejected`)."""
        if not resume_path:
            return self._ckpt.load_checkpoint(validate=validate)
        state = self._ckpt.load_checkpoint(storage=False, validate=validate)
        if state:
            return state
        storage = self._ckpt.engine.storage
        if not storage.exists(storage.path(resume_path)):
            return {}
        return self._ckpt.load_checkpoint(resume_path)

    def wait_latest_checkpoint(self, timeout: float = 1800) -> bool:
        """Waits until the newest DISK save is committed on storage; False on timeout."""
        return self._ckpt.wait_latest_checkpoint(timeout)

    def close(self) -> None:
        """Finishes this process's persists (without an agent) and releases the segments."""
        self._ckpt.close()
