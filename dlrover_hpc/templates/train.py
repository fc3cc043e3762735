"""A small DDP training script: the same file runs under torchrun, dlrover-run and sbatch.

    dlrover-run --nproc-per-node=2 train.py          # one node, two processes (CPU: gloo)
    torchrun --nproc-per-node=2 train.py             # the same, unchanged
    sbatch -N2 train.sbatch --nnodes=2 --nproc-per-node=8 train.py   # GPUs: NCCL

It trains a tiny model on random data for --steps steps (a few seconds on CPU).  With
--ckpt-dir (or the CKPT_DIR variable, which 'dlrover-hpc template sbatch' sets) rank 0 saves a
checkpoint every --ckpt-every steps and every rank resumes from it after a restart, so a lost
worker or node costs at most that many steps; without one it saves nothing.  Written by
'dlrover-hpc template train': replace the model, data and loss with yours.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument(
        "--ckpt-dir",
        default=os.environ.get("CKPT_DIR") or None,
        help="save and resume here, on storage every node sees (default: $CKPT_DIR, or none)",
    )
    p.add_argument("--ckpt-every", type=int, default=10, help="steps between saves (default 10)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    # torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) say how to join the group.
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device] if use_cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

    start = 0
    ckpt = os.path.join(args.ckpt_dir, "checkpoint.pt") if args.ckpt_dir else None
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from {ckpt} at step {start}", flush=True)

    generator = torch.Generator().manual_seed(rank)
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(64, 32, generator=generator).to(device)
        loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if ckpt and rank == 0 and (step % args.ckpt_every == 0 or step == args.steps):
            os.makedirs(args.ckpt_dir, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save({**state, "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)  # never a torn checkpoint
    if rank == 0:
        print(f"done: {args.steps} steps, world size {world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
