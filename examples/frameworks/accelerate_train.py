"""An accelerate training loop as its users write it (a small regression model on synthetic
data, `save_state`/`load_state` for checkpoints), started as torchrun would start it:

    srun dlrover-run --nnodes=2 --nproc-per-node=2 examples/frameworks/accelerate_train.py --out DIR

--flash saves through dlrover-hpc's `DirectoryCheckpointer` (accelerate's own `save_state`,
its files kept in shared memory; a memory save every step, storage every --save-steps) and
resumes from its `last_checkpoint()`; without it the script resumes from the newest
`checkpoint-<step>` directory `save_state` wrote.  --kill-at-step N --kill-rank R SIGKILLs that
rank once, before step N+1 of the first run.  Each run appends where it began and ended to
DIR/runs.jsonl (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal

import torch
from accelerate import Accelerator


def newest(directory: str) -> str | None:
    steps = [
        int(m.group(1))
        for name in (os.listdir(directory) if os.path.isdir(directory) else [])
        if (m := re.fullmatch(r"checkpoint-(\d+)", name))
    ]
    return os.path.join(directory, f"checkpoint-{max(steps)}") if steps else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--flash", action="store_true")
    p.add_argument("--kill-at-step", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=0)
    a = p.parse_args()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    layers = [torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    own_dir = os.path.join(a.out, "own")
    if a.flash:
        from dlrover_hpc.trainer.flash_checkpoint.capture import DirectoryCheckpointer

        flash = DirectoryCheckpointer(os.path.join(a.out, "flash"))
        resume = flash.last_checkpoint()
    else:
        resume = newest(own_dir)
    step = 0
    if resume:
        accelerator.load_state(resume)
        step = int(resume.rsplit("-", 1)[1])

    def note(**fields: object) -> None:
        if accelerator.is_main_process:
            with open(os.path.join(a.out, "runs.jsonl"), "a") as f:
                f.write(json.dumps({"restart": restart, **fields}) + "\n")

    os.makedirs(a.out, exist_ok=True)
    note(event="begin", step=step)
    batches = accelerator.skip_first_batches(loader, step % len(loader))
    while step < a.max_steps:
        for xb, yb in batches:
            if restart == 0 and step == a.kill_at_step and accelerator.process_index == a.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            path = f"checkpoint-{step}"
            if a.flash:
                kind = "disk" if step % a.save_steps == 0 else "memory"
                flash.save(step, os.path.join(a.out, "flash", path), accelerator.save_state, kind)
            elif step % a.save_steps == 0:
                accelerator.save_state(os.path.join(own_dir, path))
            if step >= a.max_steps:
                break
        batches = loader
    note(event="end", step=step)
    if a.flash:
        flash.wait_latest_checkpoint()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
