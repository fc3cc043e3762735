"""DDP training whose global batch stays the same while nodes come and go (DLRover's elastic
trainer API): `ElasticDistributedSampler` + `ElasticTrainer` + flash checkpoints.

Each optimizer step trains ``--global-batch`` samples: ``--micro-batch`` per micro-step on each
rank, and as many micro-steps as the world size needs (4 ranks: 3, 3 ranks: 4 for 24 of 2).
A checkpoint holds the model, the optimizer and the sampler's position, so a restart at another
world size goes on with the very samples the job had not trained.  With ``--sample-log DIR``
each rank appends one JSON line per optimizer step (round, step, its samples); rank 0 adds the
global batch's mean loss.  ``--fail-at-step N --fail-rank R`` SIGKILLs that rank once;
``--slow-while FILE`` makes each step take at least 1 s while FILE exists (a test holds the
epoch open until something it waits for has happened, however loaded the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from dlrover_hpc.checkpoint import DdpCheckpointer, StorageType
from dlrover_hpc.trainer.elastic.sampler import ElasticDistributedSampler
from dlrover_hpc.trainer.elastic.trainer import ElasticTrainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2400)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--ckpt-dir", default="./ckpt-elastic")
    p.add_argument("--save-every", type=int, default=2, help="optimizer steps between saves")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--sample-log", default=None)
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--slow-while", default=None, help="1 s per step while this file exists")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    features = torch.randn(args.samples, 16, generator=torch.Generator().manual_seed(11))
    dataset = TensorDataset(features, torch.arange(args.samples))
    sampler = ElasticDistributedSampler(dataset, shuffle=True, seed=5)
    loader = DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    net = DDP(model)
    trainer = ElasticTrainer(net, dataloader=loader, global_batch_size=args.global_batch)
    opt = trainer.prepare(torch.optim.SGD(net.parameters(), lr=0.05))

    ckpt = DdpCheckpointer(args.ckpt_dir)
    state = ckpt.load_checkpoint(state_dict={"model": model.state_dict(), "opt": opt.state_dict()})
    step, epoch, micro = 0, 0, 0
    if state:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
        sampler.load_state_dict(state["sampler"])
        epoch, micro = int(state["sampler"]["epoch"]), int(state["sampler"]["iter_step"])
    log = None
    if args.sample_log:
        os.makedirs(args.sample_log, exist_ok=True)
        log = open(os.path.join(args.sample_log, f"rank{rank}.jsonl"), "a")  # noqa: SIM115
        round_no = int(os.environ.get("DLROVER_HPC_ROUND", "0"))
        log.write(json.dumps({"round": round_no, "start": step, "world": world}) + "\n")
    marker = os.path.join(args.ckpt_dir, f".failed-once-{args.fail_rank}")
    while epoch < args.epochs:
        if not state:
            sampler.set_epoch(epoch)
            micro = 0
        state = None  # a later epoch starts from its beginning
        window: list[int] = []
        window_loss = 0.0
        for x, idx in loader:
            with trainer.step():
                loss = net(x).pow(2).mean() / trainer.gradient_accumulation_steps
                loss.backward()
                opt.step()
                opt.zero_grad()
            micro += 1
            window += idx.tolist()
            window_loss += loss.item()
            if not trainer.gradient_state.sync_gradients:
                continue  # inside an accumulation window
            step += 1
            mean = torch.tensor([window_loss])
            dist.all_reduce(mean)
            if log is not None:
                record = {"round": round_no, "step": step, "samples": window}
                if rank == 0:
                    record["loss"] = mean.item() / world
                log.write(json.dumps(record) + "\n")
                log.flush()
            window, window_loss = [], 0.0
            if args.slow_while and os.path.exists(args.slow_while):
                time.sleep(max(1.0, args.step_time))
            elif args.step_time:
                time.sleep(args.step_time)
            if step % args.save_every == 0:
                ckpt.save_checkpoint(
                    step,
                    {
                        "model": model.state_dict(),
                        "opt": opt.state_dict(),
                        "step": step,
                        "sampler": sampler.state_dict(micro, args.micro_batch),
                    },
                    storage_type=StorageType.MEMORY,
                )
            if step == args.fail_at_step and rank == args.fail_rank and not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write(str(step))
                os.kill(os.getpid(), signal.SIGKILL)
        epoch += 1
    if rank == 0:
        print(f"trained {step} steps of {args.global_batch} samples", flush=True)
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
