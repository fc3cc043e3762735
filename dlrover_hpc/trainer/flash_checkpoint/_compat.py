"""DLRover's constructor and call arguments mapped onto our checkpointers, or refused.

Each function takes DLRover's value and returns what our checkpointer needs, or raises
`UnsupportedArgument` (a `ValueError`, as DLRover raises for bad arguments) saying why and how
to proceed.  The table in this package's docstring lists every argument and its fate.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

from dlrover_hpc.checkpoint.api import StorageType
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.errors import UsageError
from dlrover_hpc.trainer.storage import (
    KeepLatestStepStrategy,
    KeepStepIntervalStrategy,
    PosixDiskStorage,
    PosixStorageWithDeletion,
)


class UnsupportedArgument(UsageError, ValueError):
    """A DLRover argument value this package does not implement; the message says why."""


def worker_env(options: dict[str, Any]) -> WorkerEnv:
    """The worker's identity (our `env=` option, else the launcher's variables), stored back
    into `options` so the checkpointer reads the same one."""
    env = options.get("env") or WorkerEnv.from_environ()
    options["env"] = env
    return env


def check_comm_backend(comm_backend: Any) -> None:
    """DLRover creates a process group of this backend for its save and load agreement; ours
    needs none for saves and agrees on the restore over the default group."""
    if not isinstance(comm_backend, str):
        raise UnsupportedArgument(f"comm_backend={comm_backend!r} must be a backend name or ''")


def check_save_timeout(save_timeout: Any) -> None:
    """DLRover's saver waits `save_timeout` s for every rank's part before skipping a step;
    ours commits a step once every part is durable and never commits an incomplete one, so
    the value is only checked."""
    if not isinstance(save_timeout, numbers.Real) or save_timeout <= 0:
        raise UnsupportedArgument(f"save_timeout={save_timeout!r} must be a positive number")


def shard_layout(local_shard_num: int, global_shard_num: int, env: WorkerEnv) -> bool:
    """False: the state is replicated (one file, rank 0's); True: every rank saves its own
    (DLRover: local_shard_num = ranks per node, global_shard_num = all ranks)."""
    local, total = int(local_shard_num), int(global_shard_num)
    total = max(total, local)  # DLRover raises global_shard_num to local_shard_num
    if local < 1:
        raise UnsupportedArgument(f"local_shard_num={local_shard_num} must be at least 1")
    if (local, total) == (1, 1):
        return False
    if (local, total) == (env.local_world_size, env.world_size):
        return True
    raise UnsupportedArgument(
        f"local_shard_num={local_shard_num}, global_shard_num={global_shard_num}: only 1 and 1 "
        f"(replicated state) or every rank a shard (local_shard_num={env.local_world_size}, "
        f"global_shard_num={env.world_size} in this world) are implemented; state sharded on "
        "some ranks only (tensor or pipeline groups) needs every rank to save its part"
    )


def check_replica_count(replica_count: Any) -> int:
    """Replicated state needs no extra replica: every node's local rank 0 keeps a full copy
    and a rank whose node lacks it receives it from a peer (the count is ignored then).
    Sharded state: each node's parts are copied to `replica_count` peer nodes' memory."""
    if isinstance(replica_count, bool) or not isinstance(replica_count, int) or replica_count < 0:
        raise UnsupportedArgument(f"replica_count={replica_count!r} must be an integer >= 0")
    return replica_count


def retention(
    checkpoint_dir: str, deletion_strategy: Any, storage: Any, options: dict[str, Any]
) -> dict[str, int]:
    """Our retention options (`keep_last` / `keep_interval`) for DLRover's deletion strategy,
    given directly or through an older DLRover's `storage=PosixStorageWithDeletion(...)`."""
    if storage is not None and not isinstance(storage, PosixDiskStorage):
        raise UnsupportedArgument(
            f"storage={type(storage).__name__}: only PosixDiskStorage and "
            "PosixStorageWithDeletion (dlrover_hpc.trainer.storage) are accepted; the saver "
            "writes through fsspec, so pass an fsspec URL as checkpoint_dir for other storage"
        )
    if isinstance(storage, PosixStorageWithDeletion):
        if deletion_strategy is not None and deletion_strategy is not storage.deletion_strategy:
            raise UnsupportedArgument("pass deletion_strategy or storage, not both")
        deletion_strategy = storage.deletion_strategy
    if deletion_strategy is None:
        return {}
    if "keep_last" in options or "keep_interval" in options:
        raise UnsupportedArgument("pass deletion_strategy or keep_last/keep_interval, not both")
    if isinstance(deletion_strategy, KeepLatestStepStrategy):
        _same_dir(deletion_strategy.checkpoint_dir, checkpoint_dir)
        return {"keep_last": deletion_strategy.max_to_keep}
    if isinstance(deletion_strategy, KeepStepIntervalStrategy):
        _same_dir(deletion_strategy.checkpoint_dir, checkpoint_dir)
        return {"keep_interval": deletion_strategy.keep_interval}
    raise UnsupportedArgument(
        f"deletion_strategy={type(deletion_strategy).__name__}: only KeepLatestStepStrategy "
        "and KeepStepIntervalStrategy (dlrover_hpc.trainer.storage) are implemented: retention "
        "runs in the agent's saver, which cannot run a strategy class of the training script; "
        "use one of them, or keep_last=N"
    )


def _same_dir(strategy_dir: str, checkpoint_dir: str) -> None:
    if _norm(strategy_dir) != _norm(checkpoint_dir):
        raise UnsupportedArgument(
            f"the deletion strategy's checkpoint_dir {strategy_dir!r} is not the "
            f"checkpointer's {checkpoint_dir!r}: retention applies to the steps this "
            "checkpointer commits, in its checkpoint_dir"
        )


def _norm(path: str) -> str:
    path = os.fspath(path)
    return path.rstrip("/") if "://" in path else os.path.abspath(path)


def storage_type(value: Any) -> StorageType:
    if not isinstance(value, StorageType):
        raise UnsupportedArgument(f"No support storage type {value}")
    return value
