"""DLRover's ``flash_checkpoint.fsdp``: `FsdpShardCheckpointer` and `FsdpFullCheckpointer`.

`FsdpShardCheckpointer` saves an FSDP module's SHARDED_STATE_DICT and its optimizer state with
torch.distributed.checkpoint through `dlrover_hpc.checkpoint.FsdpShardCheckpointer`: every
rank's part in shared memory, persisted in DCP's own layout under `<checkpoint_dir>/<step>`.
`FsdpFullCheckpointer` gathers the FULL_STATE_DICT on every rank and saves it as our
`DdpCheckpointer` does (`<checkpoint_dir>/<step>/rank_0.pt`, a torch.save file).
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.api import FullOptimStateDictConfig

from dlrover_hpc.checkpoint.trainer.fsdp_checkpointer import (
    FsdpShardCheckpointer as _ShardCheckpointer,
)
from dlrover_hpc.trainer.flash_checkpoint import _compat
from dlrover_hpc.trainer.flash_checkpoint.checkpointer import (
    SAVE_TIMEOUT,
    Checkpointer,
    StorageType,
)
from dlrover_hpc.trainer.flash_checkpoint.ddp import DdpCheckpointer
from dlrover_hpc.trainer.storage import get_checkpoint_storage

__all__ = ["FsdpFullCheckpointer", "FsdpShardCheckpointer", "StorageType"]


class FsdpShardCheckpointer(Checkpointer):
    """Flash checkpoints of an FSDP module's sharded state (DLRover's arguments and calls).

    DLRover's arguments: `checkpoint_dir`, `comm_backend` (checked), `deletion_strategy`
    (mapped to keep_last / keep_interval), `save_timeout` (checked); keyword `storage`
    (older DLRover).  Further keywords go to our checkpointer (`env`, `events`, `tag`...).
    """

    def __init__(
        self,
        checkpoint_dir: str,
        comm_backend: str = "",
        deletion_strategy: Any = None,
        save_timeout: float = SAVE_TIMEOUT,
        replica_count: int = 0,
        *,
        storage: Any = None,
        **options: Any,
    ) -> None:
        options["replica_count"] = _compat.check_replica_count(replica_count)
        _compat.check_comm_backend(comm_backend)
        _compat.check_save_timeout(save_timeout)
        options.update(_compat.retention(checkpoint_dir, deletion_strategy, storage, options))
        self.checkpoint_dir = checkpoint_dir
        self.storage = storage or get_checkpoint_storage(deletion_strategy)
        self._ckpt = _ShardCheckpointer(checkpoint_dir, **options)

    @property
    def core(self) -> _ShardCheckpointer:
        """Our checkpointer behind this one (`dlrover_hpc.checkpoint`)."""
        return self._ckpt

    @property
    def last_restored(self) -> tuple[int, str] | None:
        return self._ckpt.last_restored

    def save_checkpoint(
        self,
        step: int,
        model: Any,
        optimizer: Any = None,
        extra_sd: Mapping[str, Any] | None = None,
        path: str = "",
        storage_type: StorageType = StorageType.DISK,
    ) -> bool:
        """Saves `{"model": sharded model state, "optim": sharded optimizer state,
        **extra_sd}` (all ranks call it) to `path` (default `<checkpoint_dir>/<step>`).

        The older DLRover form `save_checkpoint(step, state_dict, path, storage_type=...)`
        (a state dict in place of the model) saves that state dict as it is."""
        storage_type = _compat.storage_type(storage_type)
        if isinstance(model, Mapping):  # older DLRover: (step, state_dict, path)
            state_dict = dict(model)
            path = optimizer if isinstance(optimizer, str) and optimizer else path
        else:
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                state_dict = {
                    "model": model.state_dict(),
                    "optim": FSDP.optim_state_dict(model, optimizer),
                }
            state_dict.update(extra_sd or {})
        path = path or posixpath.join(self.checkpoint_dir, str(step))
        return self._ckpt.save_checkpoint(step, state_dict, path, storage_type)

    def load_checkpoint(
        self, model: Any, optimizer: Any, resume_path: str = "", *, validate: Any = None
    ) -> dict[str, Any]:
        """Loads the model's and the optimizer's sharded state in place from the newest step
        held in memory (every rank agrees on it); without one, from the DCP directory
        `resume_path` when given (else the newest committed step on storage).  Returns
        `{"step": step}` (DLRover's), {} when there is no checkpoint.  Every rank calls it.
        Each rank checks its shards of what was loaded (`{"model", "optim", ...}`: non-finite
        values, `validate`); a rejected step is replaced by the next older one."""
        loaded: dict[str, Any] = {}
        checked: dict[str, Any] = {}

        def load(reader: Any) -> None:
            state_dict = {"model": model.state_dict(), "step": 0}
            dcp.load(state_dict, storage_reader=reader)
            model_sd = state_dict.pop("model", None)
            if model_sd:
                model.load_state_dict(model_sd)
            optim_state = load_sharded_optimizer_state_dict(
                model_state_dict=model_sd, optimizer_key="optim", storage_reader=reader
            )
            optim_sd = optim_state.pop("optim", None)
            if optim_sd:
                optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, optim_sd))
            loaded.clear()
            loaded.update(state_dict)
            checked.clear()
            checked.update(state_dict, model=model_sd, optim=optim_sd)

        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            if self._ckpt.load_with(
                load, storage=not resume_path, state=lambda: checked, validate=validate
            ):
                return loaded
            storage = self._ckpt.engine.storage
            if not resume_path or not storage.exists(storage.path(resume_path)):
                return {}
            load(dcp.FileSystemReader(resume_path))
        return loaded

    def get_storage_reader(self) -> Any:
        """Older DLRover: a DCP StorageReader of the newest step (memory or storage), or
        None.  Every rank must call it."""
        return self._ckpt.get_storage_reader()

    def wait_latest_checkpoint(self, timeout: float = 1800) -> bool:
        """Waits until the newest DISK save is committed on storage; False on timeout."""
        return self._ckpt.wait_latest_checkpoint(timeout)

    def close(self) -> None:
        self._ckpt.close()


class FsdpFullCheckpointer(Checkpointer):
    """Flash checkpoints of an FSDP module's full (gathered) state, as DLRover's: every rank
    gathers it (rank0_only=False) and it is saved as replicated state."""

    def __init__(
        self,
        checkpoint_dir: str,
        comm_backend: str = "",
        deletion_strategy: Any = None,
        save_timeout: float = SAVE_TIMEOUT,
        *,
        storage: Any = None,
        **options: Any,
    ) -> None:
        self._ddp = DdpCheckpointer(
            checkpoint_dir,
            comm_backend=comm_backend,
            deletion_strategy=deletion_strategy,
            save_timeout=save_timeout,
            storage=storage,
            **options,
        )
        self.checkpoint_dir = checkpoint_dir
        self.storage = self._ddp.storage

    @property
    def core(self) -> Any:
        return self._ddp.core

    @property
    def last_restored(self) -> tuple[int, str] | None:
        return self._ddp.last_restored

    def save_checkpoint(
        self,
        step: int,
        model: Any,
        optimizer: Any,
        extra_sd: Mapping[str, Any] | None = None,
        path: str = "",
        storage_type: StorageType = StorageType.DISK,
    ) -> bool:
        """Saves `{"model": full model state, "optimizer": full optimizer state, **extra_sd}`
        (all ranks call it; default path `<checkpoint_dir>/<step>/rank_<rank>.pt`)."""
        with _full_state_dict(model):
            state_dict = {
                "model": model.state_dict(),
                "optimizer": FSDP.optim_state_dict(model, optimizer),
            }
        state_dict.update(extra_sd or {})
        return self._ddp.save_checkpoint(step, state_dict, path, storage_type)

    def load_checkpoint(
        self, model: Any, optimizer: Any, resume_path: str = "", *, validate: Any = None
    ) -> dict[str, Any]:
        """Loads the newest step (memory, else `resume_path`, else storage) into the model and
        the optimizer; returns the rest of the saved dict (`extra_sd`), {} when there is no
        checkpoint.  Every rank must call it.  Checked as `DdpCheckpointer.load_checkpoint`."""
        state_dict = self._ddp.load_checkpoint(resume_path, validate=validate)
        if not state_dict:
            return {}
        model_state_dict = state_dict.pop("model", {})
        optim_state_dict = state_dict.pop("optimizer", {})
        with _full_state_dict(model):
            optim_state_dict = FSDP.optim_state_dict_to_load(
                model=model, optim=optimizer, optim_state_dict=optim_state_dict
            )
        model.load_state_dict(model_state_dict)
        optimizer.load_state_dict(optim_state_dict)
        return state_dict

    def wait_latest_checkpoint(self, timeout: float = 1800) -> bool:
        return self._ddp.wait_latest_checkpoint(timeout)

    def close(self) -> None:
        self._ddp.close()


def _full_state_dict(model: Any) -> Any:
    return FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=False),
        FullOptimStateDictConfig(rank0_only=False),
    )
