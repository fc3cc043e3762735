"""A DeepSpeed training loop as its users write it (a small regression model on synthetic
data, ZeRO stage 1, torch's AdamW so that no DeepSpeed op is built: it runs on the CPU with
gloo), started as torchrun would start it:

    srun dlrover-run --nnodes=2 --nproc-per-node=2 examples/frameworks/deepspeed_train.py --out DIR

--flash saves through dlrover-hpc's `DeepSpeedCheckpointer` (DLRover's API: DeepSpeed's own
`save_checkpoint`, its files kept in shared memory; memory every step, storage every
--save-steps) and resumes from its `load_checkpoint()`; without it the script uses DeepSpeed's
own `save_checkpoint`/`load_checkpoint` (the `latest` tag).  --kill-at-step N --kill-rank R
SIGKILLs that rank once, before step N+1 of the first run.  Each run appends where it began and
ended to DIR/runs.jsonl (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import deepspeed
import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--flash", action="store_true")
    p.add_argument("--kill-at-step", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)]
    model = torch.nn.Sequential(*layers)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = engine.global_rank
    ckpt_dir = os.path.join(a.out, "flash" if a.flash else "own")
    if a.flash:
        from dlrover_hpc.trainer.flash_checkpoint.deepspeed import (
            DeepSpeedCheckpointer,
            StorageType,
        )

        flash = DeepSpeedCheckpointer(engine, ckpt_dir)
        flash.load_checkpoint(ckpt_dir)
    elif os.path.exists(os.path.join(ckpt_dir, "latest")):
        engine.load_checkpoint(ckpt_dir)
    step = engine.global_steps

    def note(**fields: object) -> None:
        if rank == 0:
            with open(os.path.join(a.out, "runs.jsonl"), "a") as f:
                f.write(json.dumps({"restart": restart, **fields}) + "\n")

    note(event="begin", step=step)
    g = torch.Generator().manual_seed(1000 + rank)
    while step < a.max_steps:
        if restart == 0 and step == a.kill_at_step and rank == a.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(8, 16, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True))
        engine.backward(loss)
        engine.step()
        step = engine.global_steps
        if a.flash:
            kind = StorageType.DISK if step % a.save_steps == 0 else StorageType.MEMORY
            flash.save_checkpoint(ckpt_dir, storage_type=kind)
        elif step % a.save_steps == 0:
            engine.save_checkpoint(ckpt_dir)
    note(event="end", step=step)
    if a.flash:
        flash.wait_latest_checkpoint()
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
