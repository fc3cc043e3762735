"""A PyTorch Lightning script as its users write it (a small regression model on synthetic
data), started as torchrun would start it:

    srun dlrover-run --nnodes=2 --nproc-per-node=2 examples/frameworks/lightning_train.py --out DIR

Lightning picks its cluster environment from the variables it sees: under dlrover-run the
torchelastic ones and the per-worker SLURM_* ones agree (README, "The workers' environment").
--flash adds dlrover-hpc's `FlashCheckpoint` callback and resumes from its
`last_checkpoint()`; without it the script resumes from Lightning's own `last.ckpt`
(`ModelCheckpoint(save_last=True)`).  --pytorch-lightning imports the older package name
(`pytorch_lightning`, as Lightning 2.1 scripts do).  --kill-at-step N --kill-rank R SIGKILLs
that rank once, before step N+1 of the first run.  Each run appends where it began and ended to
DIR/runs.jsonl (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch

if "--pytorch-lightning" in sys.argv:
    import pytorch_lightning as L
else:
    import lightning.pytorch as L


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Record(L.Callback):
    """Rank 0 notes where each run began and ended; one rank kills itself once."""

    def __init__(self, out: str, kill_at: int, kill_rank: int) -> None:
        self.out, self.kill_at, self.kill_rank = out, kill_at, kill_rank
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def _note(self, trainer, **fields: object) -> None:
        if trainer.is_global_zero:
            with open(os.path.join(self.out, "runs.jsonl"), "a") as f:
                f.write(
                    json.dumps({"restart": self.restart, "world": trainer.world_size, **fields})
                    + "\n"
                )

    def on_train_start(self, trainer, pl_module):
        self._note(trainer, event="begin", step=trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        hit = trainer.global_step == self.kill_at and trainer.global_rank == self.kill_rank
        if self.restart == 0 and hit:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, trainer, pl_module):
        self._note(trainer, event="end", step=trainer.global_step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--flash", action="store_true")
    p.add_argument("--pytorch-lightning", action="store_true")
    p.add_argument("--kill-at-step", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    callbacks: list = [Record(a.out, a.kill_at_step, a.kill_rank)]
    if a.flash:
        from dlrover_hpc.trainer.flash_checkpoint.lightning_ckpt import FlashCheckpoint

        flash = FlashCheckpoint(os.path.join(a.out, "flash"), every_n_train_steps=a.save_steps)
        callbacks.append(flash)
        ckpt_path = flash.last_checkpoint()
        enable_checkpointing = False
    else:
        own = L.callbacks.ModelCheckpoint(
            dirpath=os.path.join(a.out, "own"),
            every_n_train_steps=a.save_steps,
            save_last=True,
            save_top_k=-1,
        )
        callbacks.append(own)
        last = os.path.join(a.out, "own", "last.ckpt")
        ckpt_path = last if os.path.exists(last) else None
        enable_checkpointing = True
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        max_steps=a.max_steps,
        callbacks=callbacks,
        enable_checkpointing=enable_checkpointing,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(Regression(), loader, ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()
