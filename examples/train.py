"""A small DDP training script that runs unchanged under torchrun and dlrover-run.

gloo on CPU, NCCL on GPU.  It saves a checkpoint every --ckpt-every steps to --ckpt-dir and
resumes from it after a restart, so a killed worker costs at most that many steps.  With
--fail-at-step N and --fail-rank R it kills itself once (SIGKILL) to demonstrate recovery.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (shared by all ranks)")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--fail-at-step", type=int, default=-1, help="SIGKILL self at this step once")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument(
        "--fail-mode",
        choices=["kill", "xid", "hang"],
        default="kill",
        help="kill: SIGKILL self; xid: log a GPU Xid 79 line and exit 1 (a fake "
        "hardware fault, to demonstrate draining); hang: block for good without stopping (a "
        "deadlock: the others wait for it in their next all-reduce)",
    )
    p.add_argument(
        "--exit-hang-rank",
        type=int,
        default=-1,
        help="this rank blocks for good after its last step and the process group's end (a "
        "deadlock in a library's teardown: a hang at exit)",
    )
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step")
    p.add_argument("--result", default=None, help="rank 0 writes a JSON summary here")
    p.add_argument("--rank-log", default=None, help="each rank writes its placement here")
    p.add_argument("--timing-log", default=None, help="rank 0 appends 'time step restart'")
    args = p.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device or "cpu")
    ddp = DDP(model, device_ids=[device] if device is not None else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    start = 0
    ckpt_path = os.path.join(args.ckpt_dir, "model.pt") if args.ckpt_dir else None
    if ckpt_path and os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location=device or "cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.rank_log:
        os.makedirs(args.rank_log, exist_ok=True)
        with open(os.path.join(args.rank_log, f"restart{restart}-rank{rank}.json"), "w") as f:
            json.dump(
                {
                    "host": socket.gethostname(),
                    "rank": rank,
                    "world_size": world,
                    "group_rank": int(os.environ.get("GROUP_RANK", 0)),
                },
                f,
            )
    marker = os.path.join(args.ckpt_dir or ".", f".failed-once-{args.fail_rank}")
    for step in range(start, args.steps):
        x = torch.randn(8, 16, device=device)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_time)
        done = step + 1
        if done == args.fail_at_step and rank == args.fail_rank and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(time.time()))
            if args.fail_mode == "xid":
                print(
                    "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, GPU has fallen off the bus.",
                    file=sys.stderr,
                    flush=True,
                )
                sys.exit(1)
            if args.fail_mode == "hang":
                threading.Event().wait()
            os.kill(os.getpid(), signal.SIGKILL)
        if ckpt_path and rank == 0 and done % args.ckpt_every == 0:
            tmp = ckpt_path + ".tmp"
            torch.save(
                {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": done}, tmp
            )
            os.replace(tmp, ckpt_path)
        if rank == 0 and args.timing_log:
            with open(args.timing_log, "a") as f:
                f.write(f"{time.time()} {done} {restart}\n")
        if rank == 0:
            print(f"step {done} loss {loss.item():.4f} world {world} restart {restart}", flush=True)
    if rank == 0 and args.result:
        with open(args.result, "w") as f:
            json.dump(
                {
                    "final_step": args.steps,
                    "world_size": world,
                    "restart_count": restart,
                    "group_world_size": int(os.environ.get("GROUP_WORLD_SIZE", 1)),
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()
    if rank == args.exit_hang_rank:
        threading.Event().wait()


if __name__ == "__main__":
    main()
