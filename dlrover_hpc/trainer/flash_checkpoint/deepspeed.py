"""DLRover's ``flash_checkpoint.deepspeed``: `DeepSpeedCheckpointer` for a DeepSpeed engine.

    engine, _, _, _ = deepspeed.initialize(...)
    checkpointer = DeepSpeedCheckpointer(engine, save_dir)
    checkpointer.load_checkpoint(save_dir)            # every rank; (None, None) when none
    ...
    checkpointer.save_checkpoint(save_dir, storage_type=StorageType.MEMORY)   # every step
    checkpointer.save_checkpoint(save_dir, storage_type=StorageType.DISK)     # every N steps

DeepSpeed's own `engine.save_checkpoint` runs unchanged into a scratch directory, its
`torch.save` calls kept as objects (`capture`); each rank's files (`mp_rank_00_model_states.pt`,
its ZeRO optimizer partition, `zero_to_fp32.py`) go into shared memory and the agent writes them
to `<save_dir>/<tag>/` in the background: DeepSpeed's own `load_checkpoint` reads them.
DeepSpeed's `latest` file is not written (a step whose files are not durable yet must not be
named); `dlrover_latest.txt` in `checkpoint_dir` names the newest committed step, and
`load_checkpoint()` finds the newest step (memory first, as `DdpCheckpointer` does).

Arguments as DLRover's: `engine`, `checkpoint_dir`; `comm_backend` (checked: the restore
agreement uses the default process group); `deletion_strategy` (`KeepLatestStepStrategy` ->
keep_last, `KeepStepIntervalStrategy` -> keep_interval); `save_timeout` (checked).  Keyword
`replica_count`: copies of each node's files in that many peer nodes' memory.
"""

from __future__ import annotations

import os
from typing import Any

from dlrover_hpc.checkpoint.api import StorageType
from dlrover_hpc.checkpoint.trainer.file_set import FileSetCheckpointer
from dlrover_hpc.trainer.flash_checkpoint import _compat
from dlrover_hpc.trainer.flash_checkpoint.capture import capture_directory
from dlrover_hpc.trainer.flash_checkpoint.checkpointer import SAVE_TIMEOUT, Checkpointer

__all__ = ["DeepSpeedCheckpointer", "StorageType"]


class DeepSpeedCheckpointer(Checkpointer):
    """Flash checkpoints of a DeepSpeed engine (see the module)."""

    def __init__(
        self,
        engine: Any,
        checkpoint_dir: str,
        comm_backend: str = "",
        deletion_strategy: Any = None,
        save_timeout: float = SAVE_TIMEOUT,
        *,
        replica_count: int = 0,
    ) -> None:
        _compat.check_comm_backend(comm_backend)
        _compat.check_save_timeout(save_timeout)
        retention = _compat.retention(checkpoint_dir, deletion_strategy, None, {})
        self.engine = engine
        self.checkpoint_dir = checkpoint_dir
        self._ckpt = FileSetCheckpointer(
            checkpoint_dir,
            keep_last=retention.get("keep_last"),
            keep_interval=retention.get("keep_interval"),
            replica_count=_compat.check_replica_count(replica_count),
        )

    @property
    def core(self) -> FileSetCheckpointer:
        return self._ckpt

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        storage_type: StorageType = StorageType.DISK,
    ) -> bool:
        """DeepSpeed's `engine.save_checkpoint(save_dir, tag, client_state)`, through shared
        memory (MEMORY) or memory then storage (DISK).  Every rank calls it (DeepSpeed's save
        is collective).  `save_latest` is accepted and ignored: see the module."""
        storage_type = _compat.storage_type(storage_type)
        step = int(self.engine.global_steps)
        tag = str(tag) if tag is not None else f"global_step{step}"
        state = dict(client_state or {})
        files = capture_directory(
            lambda scratch: self.engine.save_checkpoint(
                scratch, tag=tag, client_state=state, save_latest=False
            ),
            tag,
        )
        return self._ckpt.save_files(step, files, os.path.join(save_dir, tag), storage_type)

    def load_checkpoint(
        self,
        load_dir: str | None = None,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """DeepSpeed's `engine.load_checkpoint` of the newest step (memory first, its files
        written to storage when they are not there yet), or of `load_dir`/`tag` when a tag is
        given.  Returns DeepSpeed's (load path, client state); (None, None) when there is no
        checkpoint.  Every rank calls it."""
        if tag is None:
            found = self._ckpt.restore_files()
            if found is None:
                return None, None
            path = found[1].rstrip("/")
            load_dir, tag = os.path.dirname(path), os.path.basename(path)
        result = self.engine.load_checkpoint(
            load_dir,
            tag=tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )
        return result[0], result[1]

    def wait_latest_checkpoint(self, timeout: float = 1800) -> bool:
        """Until the newest DISK save is committed on storage; False on timeout."""
        return self._ckpt.wait_latest_checkpoint(timeout)

    def close(self) -> None:
        self._ckpt.close()
