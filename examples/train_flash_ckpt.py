"""A small DDP training script with flash checkpoints (DdpCheckpointer).

Runs as one process (`python examples/train_flash_ckpt.py`), under `torchrun` (an in-process
saver; a one-line warning says so) or under `dlrover-run` (the agent's saver persists, also
after a worker crash).  It saves to memory every --save-every steps and to disk every
--persist-every steps, and resumes from the newest consistent checkpoint after a restart.
With --fail-at-step N --fail-rank R the rank SIGKILLs itself once (a marker file in the
checkpoint directory remembers it) to demonstrate recovery; with --poison-at-step N the state
saved at step N of the first run holds a NaN, which the restore rejects.  With --sharded every
rank saves a state of its own (RankCheckpointer; a rank-specific tensor proves each rank got its own
part back), and --replicas N copies each node's parts to N peer nodes' memory.  With
--inprocess the training function runs under `dlrover_hpc.trainer.inprocess.wrap`: on a
membership change the surviving processes change rounds without a restart.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dlrover_hpc.checkpoint import DdpCheckpointer, RankCheckpointer, StorageType
from dlrover_hpc.trainer import inprocess


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-dir", default="./ckpt-flash")
    p.add_argument("--save-every", type=int, default=2, help="memory checkpoint interval")
    p.add_argument("--persist-every", type=int, default=10, help="disk checkpoint interval")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument(
        "--poison-at-step",
        type=int,
        default=-1,
        help="in the first run only, the state saved at this step holds a NaN (a restore "
        "rejects it and restores the step before)",
    )
    p.add_argument("--poison-rank", type=int, default=-1, help="only this rank's (-1: all)")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--sharded", action="store_true", help="each rank saves its own state")
    p.add_argument("--replicas", type=int, default=0, help="peer nodes holding each part")
    p.add_argument(
        "--stall-at-step",
        type=int,
        default=-1,
        help="--fail-rank sleeps (a stuck node) after saving this step, once",
    )
    p.add_argument("--result", default=None, help="rank 0 writes a JSON summary here")
    p.add_argument("--timing-log", default=None, help="rank 0 appends 'time step' per step")
    p.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="process group backend (auto: nccl with a GPU, gloo without, only when WORLD_SIZE>1; "
        "naming one starts a group even for one process)",
    )
    p.add_argument("--inprocess", action="store_true", help="survivors change rounds in-process")
    p.add_argument(
        "--ballast-mib", type=int, default=0, help="MiB of extra state in every checkpoint"
    )
    p.add_argument(
        "--until-file",
        default=None,
        help="train until this file exists (all ranks agree each step), at most --steps; the "
        "step it ends at is saved to disk",
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    (inprocess.wrap(train) if args.inprocess else train)(args)


def train(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    grouped = world > 1 or args.backend != "auto"
    if grouped:
        backend = args.backend if args.backend != "auto" else ("nccl" if use_cuda else "gloo")
        dist.init_process_group(backend)
    rank = dist.get_rank() if grouped else 0

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device or "cpu")
    net = DDP(model, device_ids=[device] if device is not None else None) if grouped else model
    opt = torch.optim.Adam(net.parameters(), lr=0.01)

    kind = RankCheckpointer if args.sharded else DdpCheckpointer
    ckpt = kind(args.ckpt_dir, keep_last=args.keep_last, replica_count=args.replicas)
    try:
        template = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        if args.sharded:
            template["rank_data"] = torch.zeros(4096)
        if args.ballast_mib:
            template["ballast"] = torch.zeros(args.ballast_mib << 18)  # float32: 4 bytes each
        state = ckpt.load_checkpoint(state_dict=template)
        start = 0
        if state:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            start = int(state["step"])
            if args.sharded:  # this rank's own part, of that step
                mine = state["rank_data"]
                assert bool((mine == rank * 100000 + start).all()), f"rank {rank}: not its part"
        restored = ckpt.last_restored

        final = args.steps
        gen = torch.Generator().manual_seed(1234 + rank)
        loss = torch.tensor(0.0)
        for step in range(start + 1, args.steps + 1):
            x = torch.randn(16, 32, generator=gen).to(device or "cpu")
            loss = (net(x) - x.sum(dim=1, keepdim=True) * 0.1).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if args.step_time:
                time.sleep(args.step_time)
            stop = bool(args.until_file) and _agreed(args.until_file, grouped)
            last = step == args.steps or stop
            if step % args.save_every == 0 or stop:
                disk = step % args.persist_every == 0 or last
                saved = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
                if (
                    step == args.poison_at_step
                    and args.poison_rank in (-1, rank)
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
                ):
                    saved["model"] = {k: v.clone() for k, v in saved["model"].items()}
                    next(iter(saved["model"].values())).view(-1)[0] = float("nan")
                if args.sharded:
                    saved["rank_data"] = torch.full((4096,), float(rank * 100000 + step))
                if args.ballast_mib:
                    saved["ballast"] = torch.full((args.ballast_mib << 18,), float(step))
                ckpt.save_checkpoint(
                    step, saved, storage_type=StorageType.DISK if disk else StorageType.MEMORY
                )
            if rank == 0 and args.timing_log:
                with open(args.timing_log, "a") as f:
                    f.write(f"{time.time()} {step}\n")
            stalled = os.path.join(args.ckpt_dir, f".stalled-once-{args.fail_rank}")
            if (
                step == args.stall_at_step
                and rank == args.fail_rank
                and not os.path.exists(stalled)
            ):
                os.makedirs(args.ckpt_dir, exist_ok=True)
                with open(stalled, "w") as f:
                    f.write(str(step))
                time.sleep(3600)  # a stuck node: the test kills it
            marker = os.path.join(args.ckpt_dir, f".failed-once-{args.fail_rank}")
            if step == args.fail_at_step and rank == args.fail_rank and not os.path.exists(marker):
                os.makedirs(args.ckpt_dir, exist_ok=True)
                with open(marker, "w") as f:
                    f.write(str(step))
                os.kill(os.getpid(), signal.SIGKILL)
            if last:
                final = step
                break

        committed = ckpt.wait_latest_checkpoint(120)
        if rank == 0 and args.result:
            with open(args.result, "w") as f:
                json.dump(
                    {
                        "start_step": start,
                        "restored": list(restored) if restored else None,
                        "final_step": final,
                        "loss": float(loss.detach()),
                        "committed": committed,
                        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                        "device": str(device or "cpu"),
                        "backend": dist.get_backend() if grouped else None,
                        "pid": os.getpid(),
                        "inprocess_restarts": inprocess.restarts(),
                    },
                    f,
                )
    except BaseException:
        # A restart reads this memory: a new process's, or the next in-process attempt's.
        ckpt.close(remove_segments=False)
        raise
    ckpt.close()
    if grouped:
        dist.barrier()
        dist.destroy_process_group()


def _agreed(path: str, grouped: bool) -> bool:
    """Whether any rank sees ``path`` (every rank gets the same answer: they stop together)."""
    seen = torch.tensor([1 if os.path.exists(path) else 0])
    if grouped:
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return bool(seen.item())


if __name__ == "__main__":
    main()
