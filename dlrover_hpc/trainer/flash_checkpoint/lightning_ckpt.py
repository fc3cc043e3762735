"""Flash checkpoints for PyTorch Lightning: the `FlashCheckpoint` callback.

    from dlrover_hpc.trainer.flash_checkpoint.lightning_ckpt import FlashCheckpoint

    flash = FlashCheckpoint("ckpt", every_n_train_steps=50)
    trainer = L.Trainer(..., callbacks=[flash])
    trainer.fit(model, ckpt_path=flash.last_checkpoint())

After every training step (every `memory_every_n_steps`) rank 0 copies Lightning's own
checkpoint dictionary (what `Trainer.save_checkpoint` writes) into shared memory, the only
blocking part; every `every_n_train_steps` the agent also writes it to
`<dirpath>/epoch=<E>-step=<S>.ckpt`, in the background.  A file that `torch.load` and
`Trainer.fit(ckpt_path=...)` read as Lightning's own.  When a process dies the agent writes
the newest memory step to storage before the restart, and `last_checkpoint()` returns it: a
killed rank loses no step.  Every rank takes part in each save (rank 0's part holds the
file), so a step is committed once all ranks have saved it.

The callback subclasses the `Callback` of the Lightning that the script imported:
`lightning.pytorch` (Lightning 2.x), else `pytorch_lightning`.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from typing import Any

from dlrover_hpc.checkpoint.api import StorageType
from dlrover_hpc.checkpoint.trainer.file_set import FileSetCheckpointer

__all__ = ["FlashCheckpoint"]

logger = logging.getLogger(__name__)


def _lightning() -> Any:
    """The Lightning namespace the script uses (`pytorch_lightning` when only that one is
    imported, else `lightning.pytorch`, else `pytorch_lightning`)."""
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        return sys.modules["pytorch_lightning"]
    try:
        return importlib.import_module("lightning.pytorch")
    except ImportError:
        return importlib.import_module("pytorch_lightning")


class FlashCheckpoint(_lightning().Callback):  # type: ignore[misc]
    """Lightning checkpoints through shared memory (see the module).

    `dirpath`: where the files go (any fsspec URL); `every_n_train_steps`: a DISK save every
    that many optimizer steps (None: only memory saves, and a DISK save at the end of
    training); `memory_every_n_steps`: a memory save every that many steps (0: off);
    `keep_last`: keep the newest N committed steps; `replica_count`: copies of each node's
    part in that many peer nodes' memory (a replaced node's state survives)."""

    def __init__(
        self,
        dirpath: str,
        every_n_train_steps: int | None = None,
        memory_every_n_steps: int = 1,
        keep_last: int | None = None,
        replica_count: int = 0,
    ) -> None:
        super().__init__()
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps={every_n_train_steps} must be 1 or more")
        if memory_every_n_steps < 0:
            raise ValueError(f"memory_every_n_steps={memory_every_n_steps} must be 0 or more")
        self.dirpath = dirpath
        self.every_n_train_steps = every_n_train_steps
        self.memory_every_n_steps = memory_every_n_steps
        self._keep_last, self._replica_count = keep_last, replica_count
        self._ckpt: FileSetCheckpointer | None = None
        self._last_saved = -1

    @property
    def checkpointer(self) -> FileSetCheckpointer:
        if self._ckpt is None:
            self._ckpt = FileSetCheckpointer(
                self.dirpath, keep_last=self._keep_last, replica_count=self._replica_count
            )
        return self._ckpt

    def path_of(self, epoch: int, step: int) -> str:
        """The file of a step, named as Lightning's `ModelCheckpoint` names it."""
        return os.path.join(self.dirpath, f"epoch={epoch}-step={step}.ckpt")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_saved:  # gradient accumulation: no optimizer step yet
            return
        every = self.every_n_train_steps
        if every and step % every == 0:
            self.save(trainer, StorageType.DISK)
        elif self.memory_every_n_steps and step % self.memory_every_n_steps == 0:
            self.save(trainer, StorageType.MEMORY)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_step != self._last_saved or self.every_n_train_steps is None:
            self.save(trainer, StorageType.DISK)
        self.checkpointer.wait_latest_checkpoint()

    def save(self, trainer: Any, storage_type: StorageType) -> bool:
        """Saves Lightning's checkpoint of this step (every rank calls it)."""
        step = trainer.global_step
        files = {}
        if trainer.is_global_zero:
            files[""] = trainer._checkpoint_connector.dump_checkpoint(False)
        self._last_saved = step
        return self.checkpointer.save_files(
            step, files, self.path_of(trainer.current_epoch, step), storage_type
        )

    def last_checkpoint(self, timeout_s: float = 600.0) -> str | None:
        """The newest checkpoint file for `fit(ckpt_path=...)`: the newest step held in
        memory (written to storage first when it is not there), else the newest committed
        one; None when there is none.  Call it on every rank before `fit` (no process group
        is up yet: each rank finds the step on its own node, and waits until rank 0's file
        is on storage)."""
        found = self.checkpointer.restore_files()
        if found is None:
            return None
        path = found[1]
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear on storage within {timeout_s:.0f} s")
            time.sleep(0.1)
        return path
