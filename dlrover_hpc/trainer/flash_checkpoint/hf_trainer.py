"""DLRover's ``flash_checkpoint.hf_trainer``: `FlashCkptTrainer`, a drop-in for HF's `Trainer`.

    from dlrover_hpc.trainer.flash_checkpoint.hf_trainer import FlashCkptTrainer

    trainer = FlashCkptTrainer(model=model, args=args, train_dataset=ds)
    last = trainer.get_last_checkpoint()          # every rank: False when there is none
    trainer.train(resume_from_checkpoint=last or None)

Hugging Face's own `_save_checkpoint` runs unchanged, into a scratch directory, with its
`torch.save` and safetensors writes kept as objects (`capture`); the files go into shared
memory as they would be on disk (`FileSetCheckpointer`) and the agent writes them to
`<output_dir>/checkpoint-<step>/` in the background.  So a checkpoint directory is exactly
what HF writes (`model.safetensors`, `optimizer.pt`, `scheduler.pt`, `trainer_state.json`,
`rng_state_<rank>.pth`, ...) and `Trainer.train(resume_from_checkpoint=...)` reads it.

Beyond DLRover: a memory save every `memory_save_steps` optimizer steps (default 1: every
step) between HF's saves at `save_steps`.  When a process dies the agent writes the newest
memory step to storage before the restart, and `get_last_checkpoint()` finds it: a killed
rank loses no step.  `dlrover_latest.txt` in `output_dir` names the newest committed step,
as in DLRover; directories of steps saved but not yet durable may exist without it.

Differences from HF's `Trainer`: `save_total_limit` is applied by the saver after each commit
(keep the newest N committed steps; the best model's directory is not kept apart), and
`push_to_hub` turns the memory saves off (HF would push every one).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from dlrover_hpc.checkpoint.api import StorageType
from dlrover_hpc.checkpoint.trainer.file_set import FileSetCheckpointer
from dlrover_hpc.trainer.flash_checkpoint.capture import capture_directory

__all__ = ["FlashCkptTrainer"]

logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"


class _MemorySaves(TrainerCallback):
    """A memory save at the end of every `every`-th step that HF does not save itself."""

    def __init__(self, trainer: FlashCkptTrainer, every: int) -> None:
        self.trainer = trainer
        self.every = every

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_save or state.global_step % self.every:
            return
        self.trainer.flash_save(StorageType.MEMORY)


class FlashCkptTrainer(Trainer):
    """HF's `Trainer` whose checkpoints go through shared memory (see the module)."""

    def __init__(self, *args: Any, memory_save_steps: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if memory_save_steps < 0:
            raise ValueError(f"memory_save_steps={memory_save_steps} must be 0 (off) or more")
        if memory_save_steps and self.args.push_to_hub:
            logger.warning("flash checkpoint: memory saves are off with push_to_hub")
            memory_save_steps = 0
        if memory_save_steps:
            self.add_callback(_MemorySaves(self, memory_save_steps))
        self._flash: FileSetCheckpointer | None = None

    @property
    def flash_checkpointer(self) -> FileSetCheckpointer:
        """The checkpointer of `output_dir` (made on first use)."""
        if self._flash is None:
            limit = self.args.save_total_limit
            self._flash = FileSetCheckpointer(
                str(self.args.output_dir), keep_last=limit if limit and limit > 0 else None
            )
        return self._flash

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self.flash_save(StorageType.DISK, trial)

    def flash_save(self, storage_type: StorageType, trial: Any = None) -> bool:
        """Saves this step's checkpoint, as HF's `_save_checkpoint` lays it out, to memory
        (MEMORY) or to memory and then storage (DISK).  Every rank calls it."""
        step = self.state.global_step
        run_dir = self._get_output_dir(trial=trial)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{step}"

        def write(scratch: str) -> None:
            self._get_output_dir = lambda trial=None: scratch  # type: ignore[method-assign,misc]
            try:
                super(FlashCkptTrainer, self)._save_checkpoint(self.model_wrapped, trial)
            finally:
                del self._get_output_dir
            self._point_best_at(scratch, run_dir)
            if self.args.should_save:  # again, with the real directory of the best model
                state_json = os.path.join(scratch, folder, TRAINER_STATE_NAME)
                os.makedirs(os.path.dirname(state_json), exist_ok=True)
                self.state.save_to_json(state_json)

        files = capture_directory(write, folder)
        return self.flash_checkpointer.save_files(
            step, files, os.path.join(run_dir, folder), storage_type
        )

    def _point_best_at(self, scratch: str, run_dir: str) -> None:
        best = self.state.best_model_checkpoint
        if best and best.startswith(scratch):
            self.state.best_model_checkpoint = run_dir + best[len(scratch) :]
        elif getattr(self.state, "best_global_step", None):
            candidate = os.path.join(
                run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}"
            )
            if os.path.isdir(candidate):
                self.state.best_model_checkpoint = candidate

    def get_last_checkpoint(self) -> str | bool:
        """The directory of the newest checkpoint, for `train(resume_from_checkpoint=...)`:
        the newest step any node holds in memory (its files written to storage first when
        they are not there yet), else the newest committed one; False when there is none.
        Every rank must call it (the ranks agree on the step)."""
        found = self.flash_checkpointer.restore_files()
        if found is None:
            return False
        return found[1]

    def wait_latest_checkpoint(self, timeout: float = 1800) -> bool:
        """Until the newest DISK save is committed on storage; False on timeout."""
        return self.flash_checkpointer.wait_latest_checkpoint(timeout)
